# Python runner image for machines with a registry (`python -m sandbox.images build --method dockerfile`).
# Offline machines get an equivalent image from debootstrap + docker import (sandbox/images.py).
FROM python:3.11-slim
# the backend runs `python3`; util-linux (ipcrm) is part of the base image
RUN ln -sf /usr/local/bin/python3 /usr/bin/python3 2>/dev/null || true
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 65534:65534
WORKDIR /tmp
