"""``grpo sandbox ...``: build the sandbox images, check or try the sandbox. The sandbox package is the
library (sandbox.api.score, sandbox.images); these commands only parse arguments and print.

    grpo sandbox build-images [--force] [--method auto|dockerfile|debootstrap] [--only python|rust]
    grpo sandbox check                      # engine, images, bubblewrap, chosen backend
    grpo sandbox run-file CODE TESTS.json --language python|rust [--entry-point NAME] [--backend B]
    grpo sandbox reap                       # remove sandbox containers left by dead processes
"""
from __future__ import annotations

import argparse
import json

from sandbox.images import add_build_args, run_build


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``sandbox`` command to an argparse ``subparsers`` object; returns its parser."""
    p = subparsers.add_parser("sandbox", help="build sandbox images, check or try the sandbox",
                              description="Build the sandbox images, check the sandbox, run one file in it.")
    sub = p.add_subparsers(dest="sandbox_cmd", required=True)

    b = sub.add_parser("build-images", help="build the Python and Rust sandbox images")
    add_build_args(b)
    b.set_defaults(func=cmd_build_images)

    c = sub.add_parser("check", help="report engine, images, bubblewrap and the backend 'auto' picks")
    c.set_defaults(func=cmd_check)

    r = sub.add_parser("run-file", help="run one code file against a tests JSON file; print the verdict")
    r.add_argument("code", help="source file (the completion's code)")
    r.add_argument("tests", help="JSON file with the tests dict (see sandbox/api.py)")
    r.add_argument("--language", required=True, choices=["python", "rust"], help="the code's language")
    r.add_argument("--entry-point", default=None, help="function name (python)")
    r.add_argument("--backend", default="auto", choices=["auto", "docker", "local", "unisolated"],
                   help="where the code runs, as sandbox.backend (default: auto)")
    r.set_defaults(func=cmd_run_file)

    x = sub.add_parser("reap", help="remove sandbox containers whose owning process is gone")
    x.set_defaults(func=cmd_reap)
    return p


def cmd_build_images(args) -> int:
    return run_build(args)


def cmd_check(args) -> int:
    from sandbox.docker_backend import docker_available, engine_answers
    from sandbox.images import IMAGES, image_exists
    from sandbox.local_backend import bwrap_problem
    engine = engine_answers()
    print(f"docker engine: {'answers' if engine else 'NOT answering (run infra/setup_docker.sh as root)'}")
    if engine:
        for ref in IMAGES.values():
            print(f"image {ref}: {'present' if image_exists(ref) else 'MISSING (grpo sandbox build-images)'}")
    problem = bwrap_problem()
    print(f"bubblewrap: {'works' if problem is None else f'NOT usable: {problem} (apt-get install bubblewrap)'}")
    print("backend 'auto' picks: " + ("docker" if docker_available() else "local (weaker)" if problem is None else
                                      "nothing: it refuses to run code unisolated (start Docker or install bubblewrap)"))
    return 0


def cmd_run_file(args) -> int:
    from sandbox.types import Job
    from sandbox.api import score
    with open(args.code, encoding="utf-8") as f:
        code = f.read()
    with open(args.tests, encoding="utf-8") as f:
        tests = json.load(f)
    v = score(Job(language=args.language, code=code, tests=tests, entry_point=args.entry_point,
                  id=args.code), backend=args.backend)
    print(json.dumps(v.to_dict(), indent=2))
    return 0 if v.status == "pass" else 1


def cmd_reap(args) -> int:
    from sandbox.docker_backend import reap_leftovers
    print(f"removed {reap_leftovers()} container(s)")
    return 0

