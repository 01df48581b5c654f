# Rust image for machines with a registry: Debian's rustc/cargo/clippy (same toolchain as the
# offline debootstrap build, so verdicts do not depend on how the image was made).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 rustc cargo rust-clippy libc6-dev gcc \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 65534:65534
WORKDIR /tmp
