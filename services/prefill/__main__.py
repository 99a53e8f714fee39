"""`python -m kvmesh.services.prefill` == `kvmesh prefill`."""
import sys

from kvmesh.cli import main

sys.exit(main(["prefill", *sys.argv[1:]]))
