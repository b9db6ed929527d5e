#!/usr/bin/env bash
# On the GPU machine: every candidate wheel that build_wheels.sh made (dist/<patch name>/)
# against HEAD's (dist/head/), carried with "dist" and ".whl" (the peers' wheels and
# expecttest). Steps (STEPS, default ab,test,sanitize; CANDIDATES: names, default every built one):
#
#   ab        each distinct `ab-command:` of the candidates' patches, ROUNDS alternating rounds
#             (default 3) of HEAD and every candidate, through benchmarks/ab_wheels.sh
#   test      per candidate, the GPU tests its patch's `gpu-tests:` line selects (a pytest -k
#             expression), CUDA backend then Triton, from a copy of this tree with the patch
#             applied (a patch may add tests), under the candidate's wheel
#   sanitize  per candidate, compute-sanitizer memcheck over the same tests in test_ops.py and
#             test_cuda.py on the CUDA backend, less what gpu_session.sh leaves out of its own
#             sanitizer step (and says why there)
#
# Logs go to $OUT (default ./gpu-out/candidates), one line of result per step to stdout. A GPU
# call is at most 10 minutes, and this script has not run on a GPU yet (written on
# 2026-12-08, a day without a GPU): start with STEPS=ab in one call and the rest in the next,
# on the still-warm machine, or one candidate a call (CANDIDATES=).
#
#   bash benchmarks/candidates/measure.sh
#   STEPS=test,sanitize CANDIDATES=layer_norm_1024_one_pass bash benchmarks/candidates/measure.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(cd "$here/../.." && pwd)
OUT=${OUT:-$tree/gpu-out}/candidates
mkdir -p "$OUT"
STEPS=${STEPS:-ab,test,sanitize}
xdist=${XDIST-8}  # pytest-xdist workers for the tests (the GPU machine has it); XDIST= for none
has() { [[ ",$STEPS," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1
# The GPU machine's default CXX links libstdc++ statically (gpu_session.sh says what that breaks).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
field() { sed -n "s/^$2: //p" "$1"; }  # a header field of a patch: its lines
cd "$tree"

names=()
for dir in dist/*/; do
  name=$(basename "$dir")
  [ "$name" != head ] || continue
  [ -z "${CANDIDATES:-}" ] || [[ ",$CANDIDATES," == *",$name,"* ]] || continue
  [ -f "$here/$name.patch" ] || { echo "dist/$name/ has no patch $here/$name.patch" >&2; exit 2; }
  names+=("$name")
done
[ -d dist/head ] && [ ${#names[@]} -gt 0 ] || {
  echo "no wheels to compare: build them with benchmarks/candidates/build_wheels.sh, carry dist and .whl" >&2
  exit 2
}
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); candidates: ${names[*]}" | tee "$OUT/gpu.txt"
status=0

if has ab; then
  wheels=(dist/head/*.whl)
  for name in "${names[@]}"; do wheels+=(dist/"$name"/*.whl); done
  mapfile -t commands < <(for name in "${names[@]}"; do field "$here/$name.patch" ab-command; done | sort -u)
  for command in "${commands[@]}"; do
    echo "== $command" | tee -a "$OUT/ab.log"
    # (split into words on purpose: the field is one line of plain arguments)
    # shellcheck disable=SC2086
    ROUNDS=${ROUNDS:-3} bash benchmarks/ab_wheels.sh "${wheels[@]}" -- $command 2>&1 | tee -a "$OUT/ab.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi

has test || has sanitize || exit $status
for name in "${names[@]}"; do
  patch="$here/$name.patch"
  selection=$(field "$patch" gpu-tests | head -1)
  [ -n "$selection" ] || { echo "$name.patch has no gpu-tests: line" >&2; status=1; continue; }
  work=/tmp/fusedops-candidate/$name-tree
  rm -rf "$work" && mkdir -p "$work"
  tar --exclude=./.git --exclude=./.venv --exclude=./dist --exclude=./.whl --exclude=./build \
    --exclude=./gpu-out -cf - . | tar -xf - -C "$work"
  if command -v git >/dev/null; then apply=(git apply); else apply=(patch -p1 -s); fi
  (cd "$work" && "${apply[@]}" <"$patch") || { echo "$name: the patch does not apply" >&2; status=1; continue; }
  # The wheel with the peers and this tree's Python (the patch leaves src/ as it is), where the
  # A/B puts it.
  site=${AB_DIR:-/tmp/fusedops-ab}/$name
  ROUNDS=1 bash benchmarks/ab_wheels.sh dist/"$name"/*.whl -- true >/dev/null || { status=1; continue; }
  if has test; then
    for backend in cuda triton; do
      (cd "$work" && PYTHONPATH=$site FUSEDOPS_BACKEND=$backend timeout ${TEST_TIMEOUT:-300} \
        python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs ${xdist:+-n $xdist} -k "$selection") \
        >"$OUT/test-$name-$backend.log" 2>&1 || status=1
      echo "$name tests ($backend, -k '$selection'): $(tail -1 "$OUT/test-$name-$backend.log")"
    done
  fi
  if has sanitize; then
    (cd "$work" && PYTHONPATH=$site FUSEDOPS_BACKEND=cuda timeout ${SANITIZE_TIMEOUT:-400} \
      compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu tests/test_ops.py \
      tests/test_cuda.py -v -rf --tb=short -p no:cacheprovider \
      -k "($selection) and not 2_31 and not compile and not gradcheck and not graph and not opcheck and not export") \
      >"$OUT/sanitizer-$name.log" 2>&1 || status=1
    echo "$name compute-sanitizer: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-$name.log" | tail -1)" \
      "$(tail -1 "$OUT/sanitizer-$name.log")"
  fi
done
exit $status
