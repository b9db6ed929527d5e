"""Device copy bandwidth by size, timed as the harness times its yardstick (GPU by default).

The harness reports every op against one large copy (2 GiB each way on a GPU). A smaller op
moves fewer bytes, and a copy of its size does not reach that figure either (the ramp at the
start, the drain at the end and the write-back of the cache flush's dirty lines weigh more):
this prints the copy's TB/s (bytes read + written / median time) for copies of 64 MiB to
2 GiB, for comparison.

    python benchmarks/copy_by_size.py [--device cpu]
"""

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Started as a script: make the repository root importable (as benchmarks/run.py does).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for mib in (64, 128, 256, 512, 1024, 2048):
        copy = harness.copy_bandwidth(args.device, mib << 20)
        print(f"copy of {mib} MiB: {copy['copy_tbps']:.3f} TB/s ({copy['copy_ms'] * 1e3:.1f} us)")


if __name__ == "__main__":
    main()
