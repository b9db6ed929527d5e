#!/usr/bin/env bash
# A/B of builds on one GPU machine: installs each wheel in a directory of its own (with the peer
# wheels in .whl/, and this tree's Python package copied over the wheel's, so that only the
# native code differs), then runs one command under each in turn, ROUNDS times (default 3),
# each output line prefixed with the wheel's label. Alternating rounds in one process tree on one
# warm machine is what separates a kernel change of 1-2% from the drift between runs.
#
#   bash benchmarks/ab_wheels.sh dist/head/*.whl dist/candidate/*.whl -- \
#       python3 benchmarks/norm_forward_ab.py --ops layer_norm
#
# A wheel's label is the name of its directory (head, candidate), so build each in its own.
# Wheels built here against torch 2.14.1's headers load under the GPU machine's torch by the
# stable ABI (docs/design.md); carry "dist" and ".whl" with the call.
set -euo pipefail
wheels=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do wheels+=("$1"); shift; done
[ $# -gt 1 ] && [ ${#wheels[@]} -gt 0 ] || {
  echo "usage: bash benchmarks/ab_wheels.sh WHEEL... -- COMMAND..." >&2
  exit 2
}
shift
root=${AB_DIR:-/tmp/fusedops-ab}
peers=()
[ -d .whl ] && peers=(.whl/*.whl)
labels=()
for wheel in "${wheels[@]}"; do
  label=$(basename "$(dirname "$wheel")")
  for seen in "${labels[@]}"; do
    [ "$seen" != "$label" ] || { echo "two wheels share the label '$label': put each in a directory of its own" >&2; exit 2; }
  done
  labels+=("$label")
  rm -rf "$root/$label"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$root/$label" "$wheel" "${peers[@]}"
  cp -r src/fusedops/. "$root/$label/fusedops/"
done
for round in $(seq "${ROUNDS:-3}"); do
  for label in "${labels[@]}"; do
    PYTHONPATH="$root/$label" "$@" 2>&1 | sed "s/^/$label #$round: /"
  done
done
