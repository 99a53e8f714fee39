"""`python -m kvmesh.operator`: run the kopf operator with kvmesh's handlers.

Standalone (no peering objects): the chart runs one replica with a Recreate strategy, so two
operators never reconcile the same objects at once.
"""

from __future__ import annotations

import argparse
import logging

from .config import OperatorConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvmesh.operator")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch only this namespace (repeatable; globs allowed)"
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (the default when no --namespace is given)",
    )
    p.add_argument(
        "--liveness",
        default=OperatorConfig.from_env().liveness,
        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz (default: $KVMESH_OPERATOR_LIVENESS)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import warnings

    import kopf
    import urllib3

    # A kubeconfig with insecure-skip-tls-verify (test clusters) would warn on every request.
    warnings.simplefilter("once", urllib3.exceptions.InsecureRequestWarning)

    from . import handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(namespaces=tuple(namespaces)),  # the startup handlers' memo: what the timers watch
    )


if __name__ == "__main__":
    main()
