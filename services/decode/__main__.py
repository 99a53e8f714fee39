"""`python -m kvmesh.services.decode` == `kvmesh decode`."""
import sys

from kvmesh.cli import main

sys.exit(main(["decode", *sys.argv[1:]]))
