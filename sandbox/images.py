"""Build the sandbox images, whichever way this machine allows.

    python -m sandbox.images build [--force] [--method auto|dockerfile|debootstrap]
    python -m sandbox.images status

``auto``: an image that exists is kept; else ``docker build`` from ``infra/images/*.Dockerfile``
when a registry answers; else the offline builder: ``debootstrap --variant=minbase`` from the
Debian mirror in this machine's apt sources, then ``tar | docker import``. Images made by
``docker import`` have an empty config; the backend sets PATH, user and workdir on every run.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMAGES = {"python": "grpo-sandbox-python:1", "rust": "grpo-sandbox-rust:1"}

# python3 (not python3-minimal: that lacks json); util-linux (ipcrm) is essential anyway.
DEBIAN_PACKAGES = {
    "python": ["python3"],
    "rust": ["python3", "rustc", "cargo", "rust-clippy", "libc6-dev", "gcc"],
}
DOCKERFILES = Path(__file__).resolve().parent.parent / "infra" / "images"
SUITE = "bookworm"
IMPORT_CHANGES = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "USER 65534:65534", "WORKDIR /tmp"]


class ImageBuildError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"[sandbox.images] {msg}", file=sys.stderr, flush=True)


def image_exists(ref: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", ref], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def registry_reachable(timeout: float = 8.0) -> bool:
    """True when Docker Hub answers (so ``FROM python:3.11-slim`` can be pulled)."""
    import urllib.request
    try:
        urllib.request.urlopen("https://registry-1.docker.io/v2/", timeout=timeout)
        return True
    except urllib.error.HTTPError:
        return True   # 401 Unauthorized: it answered
    except Exception:  # noqa: BLE001
        return False


def debian_mirror() -> str:
    """The Debian mirror named in this machine's apt sources (deb822 or one-line format)."""
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            texts.append(p.read_text())
        except OSError:
            continue
    for text in texts:
        for url in re.findall(r"(?:URIs:\s*|^deb\s+(?:\[[^\]]*\]\s*)?)(\S+)", text, re.M):
            if "security" not in url and "debian" in url:
                return url.rstrip("/")
    return "http://deb.debian.org/debian"


def build_dockerfile(language: str, ref: str) -> None:
    dockerfile = DOCKERFILES / f"{language}.Dockerfile"
    _log(f"docker build {ref} from {dockerfile}")
    subprocess.run(["docker", "build", "-t", ref, "-f", str(dockerfile), str(DOCKERFILES)], check=True)


def build_debootstrap(language: str, ref: str, mirror: str | None = None) -> None:
    debootstrap_import(ref, DEBIAN_PACKAGES[language], IMPORT_CHANGES, mirror)


def debootstrap_import(ref: str, packages: list[str], changes: list[str], mirror: str | None = None) -> None:
    """A Debian bookworm minbase root filesystem with `packages`, imported as image `ref` with the
    Dockerfile instructions `changes` (an imported image has no config of its own)."""
    for tool in ("debootstrap", "docker", "tar"):
        if not shutil.which(tool):
            raise ImageBuildError(f"{tool} is not installed; run infra/setup_docker.sh as root")
    if os.geteuid() != 0:
        raise ImageBuildError("debootstrap needs root; run as root (or use a machine with a registry)")
    mirror = mirror or debian_mirror()
    pkgs = ",".join(packages)
    with tempfile.TemporaryDirectory(prefix="grpo-debootstrap-") as tmp:
        rootfs = os.path.join(tmp, "rootfs")
        _log(f"debootstrap --variant=minbase --include={pkgs} {SUITE} from {mirror} (~1 min)")
        t0 = time.time()
        r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={pkgs}", SUITE, rootfs,
                            mirror], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise ImageBuildError(f"debootstrap failed (rc {r.returncode}):\n{r.stdout[-3000:]}")
        shutil.rmtree(os.path.join(rootfs, "var/cache/apt/archives"), ignore_errors=True)
        _log(f"debootstrap done in {time.time() - t0:.0f}s; docker import {ref}")
        cmd = ["docker", "import"] + [a for c in changes for a in ("-c", c)] + ["-", ref]
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(cmd, stdin=tar.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise ImageBuildError(f"docker import failed: {imp.stderr[-2000:]}")


def build(languages=("python", "rust"), force: bool = False, method: str = "auto") -> dict[str, str]:
    """Build missing images. Returns {language: "exists"|"dockerfile"|"debootstrap"}."""
    if method not in ("auto", "dockerfile", "debootstrap"):
        raise ValueError("method must be auto, dockerfile or debootstrap")
    done, reachable = {}, None
    for lang in languages:
        ref = IMAGES[lang]
        if image_exists(ref) and not force:
            _log(f"{ref} exists; skipping (use --force to rebuild)")
            done[lang] = "exists"
            continue
        how = method
        if how == "auto":
            reachable = registry_reachable() if reachable is None else reachable
            how = "dockerfile" if reachable else "debootstrap"
            _log(f"registry {'reachable' if reachable else 'unreachable'}: building {ref} by {how}")
        (build_dockerfile if how == "dockerfile" else build_debootstrap)(lang, ref)
        done[lang] = how
    return done


def status() -> dict[str, bool]:
    return {ref: image_exists(ref) for ref in IMAGES.values()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.images", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build missing sandbox images")
    add_build_args(b)
    sub.add_parser("status", help="which sandbox images exist")
    args = ap.parse_args(argv)
    if args.cmd == "status":
        for ref, ok in status().items():
            print(f"{ref}: {'present' if ok else 'MISSING'}")
        return 0
    return run_build(args)


def add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.add_argument("--method", default="auto", choices=["auto", "dockerfile", "debootstrap"],
                   help="dockerfile (needs a reachable registry), debootstrap (offline), or auto: dockerfile "
                        "when the registry answers (default: auto)")
    p.add_argument("--only", choices=sorted(IMAGES), help="build just one language's image")


def run_build(args) -> int:
    try:
        langs = (args.only,) if getattr(args, "only", None) else ("python", "rust")
        for lang, how in build(langs, force=args.force, method=args.method).items():
            print(f"{IMAGES[lang]}: {how}")
    except (ImageBuildError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
