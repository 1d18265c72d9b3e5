"""``python -m hpf``: the same as the ``hpf`` command."""
from hpf.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
