#!/usr/bin/env bash
set -u
cd "$(dirname "$0")"
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
for v in old new; do
  d=/tmp/fo-$v; w=$([ $v = old ] && ls dist-old/*.whl || ls dist/*.whl)
  rm -rf $d; python3 -m pip install -q --no-index --no-deps --no-compile --target $d $w; cp -r src/fusedops/. $d/fusedops/
done
START=$SECONDS
export PYTHONPATH=/tmp/fo-new:/tmp/site
for b in cuda triton; do
  FUSEDOPS_BACKEND=$b timeout 110 python3 -m pytest -m gpu tests/test_norm_options.py tests/test_ops.py -q -p no:cacheprovider -n 4 -k "layer_norm or far_from_zero or wide" >$OUT/norm-$b.log 2>&1 &
done; wait
for b in cuda triton; do echo "norm tests ($b) at $((SECONDS-START)) s: $(tail -1 $OUT/norm-$b.log)"; grep -E "^(FAILED|ERROR)" $OUT/norm-$b.log | head -5; done
FUSEDOPS_BACKEND=cuda timeout 40 python3 ln_far_probe.py cuda-new
FUSEDOPS_BACKEND=triton timeout 40 python3 ln_far_probe.py triton-new
PYTHONPATH=/tmp/fo-old:/tmp/site FUSEDOPS_BACKEND=cuda timeout 40 python3 ln_far_probe.py cuda-old
timeout 70 python3 -X faulthandler -m pytest tests/test_nn.py -k "aot_inductor and cuda" -x -q -p no:cacheprovider >$OUT/aoti-usr-gxx.log 2>&1
echo "aoti with CXX=/usr/bin/g++ rc=$? at $((SECONDS-START)) s: $(tail -1 $OUT/aoti-usr-gxx.log)"
if ! grep -q "1 passed" $OUT/aoti-usr-gxx.log; then
  grep -v "^  File" $OUT/aoti-usr-gxx.log | tail -15
  # the control: a plain torch model, no fusedops op, with the machine's default compiler
  env -u CXX -u CUDAHOSTCXX timeout 80 python3 -X faulthandler -c "
import torch
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda().eval()
p = torch.export.export(m, (torch.randn(4, 64, device='cuda'),))
pkg = torch._inductor.aoti_compile_and_package(p, package_path='/tmp/plain.pt2')
c = torch._inductor.aoti_load_package(pkg); print('plain torch AOTI on cuda:', c(torch.randn(4, 64, device='cuda')).shape)
" >$OUT/aoti-plain.log 2>&1; echo "plain AOTI (default CXX) rc=$?"; tail -3 $OUT/aoti-plain.log
fi
for v in old new old new; do PYTHONPATH=/tmp/fo-$v:/tmp/site FUSEDOPS_BACKEND=cuda timeout 60 python3 ln_far_probe.py cuda-$v time 2>&1 | grep time; done
