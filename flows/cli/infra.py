"""``grpo infra ...``: the shared stack (PostgreSQL, Prefect server, MLflow server, a worker) of
infra/docker-compose.yml. flows/stack.py is the library; these commands parse arguments and print.

    grpo infra up [--expose | --auth] [--prefect-port N] [--mlflow-port N] [--images auto|local|upstream] [--rebuild]
    grpo infra status [--show-secrets]
    grpo infra down [--volumes]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from grpo_core.config import ConfigError


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``infra`` command to an argparse ``subparsers`` object; returns its parser."""
    p = subparsers.add_parser(
        "infra", help="bring the shared stack (Prefect + MLflow servers, PostgreSQL, a worker) up or down",
        description="The shared stack of infra/docker-compose.yml: PostgreSQL, the Prefect server, the MLflow "
                    "tracking server (PostgreSQL store, artifacts on a volume) and a worker of the work pool "
                    "`gpu-pool`. Ports listen on 127.0.0.1 only unless --expose; passwords are generated into "
                    "an env file (mode 600) under $GRPO_HOME/stack/ on the first `up`.")
    p.add_argument("--project-name", "-p", default=os.environ.get("GRPO_STACK_PROJECT", "grpo-stack"),
                   help="compose project name: one stack per name, with its own volumes and env file "
                        "(default: $GRPO_STACK_PROJECT or grpo-stack)")
    sub = p.add_subparsers(dest="infra_cmd", required=True, metavar="<up|status|down>")

    u = sub.add_parser("up", help="build missing images, generate secrets, start the stack, wait until healthy",
                       description="Build the images that are missing (offline with debootstrap and a local "
                                   "wheelhouse when no registry answers), write the env file, `compose up -d`, and "
                                   "wait until every service is healthy. Safe to run again.")
    u.add_argument("--expose", action="store_true",
                   help="listen on all addresses (default: 127.0.0.1 only); turns auth on")
    u.add_argument("--auth", action="store_true",
                   help="MLflow basic-auth and a Prefect auth string, also on 127.0.0.1 (always on with --expose)")
    u.add_argument("--public-host", help="with --expose: the name clients use for this machine (default: its FQDN)")
    u.add_argument("--prefect-port", type=int, help="host port of the Prefect server (default: the last one, or 4200)")
    u.add_argument("--mlflow-port", type=int, help="host port of the MLflow server (default: the last one, or 5000)")
    u.add_argument("--images", default="auto", choices=["auto", "local", "upstream"],
                   help="local: build every image here (debootstrap + wheelhouse); upstream: postgres and "
                        "prefecthq/prefect from a registry; auto (default): local ones if present, else upstream "
                        "when a registry answers, else local")
    u.add_argument("--rebuild", action="store_true",
                   help="rebuild the local PostgreSQL and project images (after changing the code); "
                        "the Debian base is kept")
    u.add_argument("--timeout", type=float, default=600, help="seconds to wait for health (default: 600)")
    u.set_defaults(func=cmd_up)

    s = sub.add_parser("status", help="health of each service, one line each, and the exports a client needs")
    s.add_argument("--show-secrets", action="store_true",
                   help="print the credentials themselves in the exports (default: read from the env file)")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("down", help="stop and remove the stack's containers")
    d.add_argument("--volumes", action="store_true", help="also delete its databases, artifacts and runs")
    d.set_defaults(func=cmd_down)
    return p


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _print_status(project: str, show_secrets: bool = False) -> bool:
    from flows import stack
    lines = stack.status(project)
    for s in lines:
        print(s.line())
    values = stack.read_env(stack.env_path(project))
    if values:
        auth = "on" if values.get("GRPO_STACK_AUTH") == "1" else "off"
        print(f"\nlistening on {values.get('GRPO_STACK_BIND')}, auth {auth}; env file {stack.env_path(project)}")
        print("client settings:\n  " + "\n  ".join(stack.client_exports(project, values, show_secrets)))
    return all(s.ok for s in lines)


def cmd_up(args) -> int:
    from flows import stack
    if args.public_host and not args.expose:
        raise ConfigError("--public-host applies only with --expose")
    t0 = time.time()
    try:
        stack.up(args.project_name, images=args.images, rebuild=args.rebuild, expose=args.expose, auth=args.auth,
                 prefect_port=args.prefect_port, mlflow_port=args.mlflow_port, public_host=args.public_host,
                 timeout=args.timeout)
    except stack.StackError as e:
        return _fail(e)
    print(f"stack {args.project_name!r} up and healthy in {time.time() - t0:.0f}s\n")
    _print_status(args.project_name)
    return 0


def cmd_status(args) -> int:
    from flows import stack
    try:
        stack.compose_command()
    except stack.StackError as e:
        return _fail(e)
    return 0 if _print_status(args.project_name, args.show_secrets) else 1


def cmd_down(args) -> int:
    from flows import stack
    try:
        stack.down(args.project_name, volumes=args.volumes)
    except stack.StackError as e:
        return _fail(e)
    print(f"stack {args.project_name!r} down" + (" (volumes deleted)" if args.volumes else
                                                 "; its volumes are kept (`--volumes` deletes them)"))
    return 0
