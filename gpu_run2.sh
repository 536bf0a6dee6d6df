set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run() { local t=$1; shift; echo "=== $*"; timeout $t "$@" 2>&1 | tail -40; }
run 90 python3 benchmarks/norms_gpu.py --out $OUT/norms
run 60 python3 benchmarks/inject_gpu.py --out $OUT/inject
run 90 python3 benchmarks/host_groups.py --out $OUT/hostgroups
run 150 python3 benchmarks/muon_vs_adamw.py --out $OUT/muonadamw --amp
run 170 python3 benchmarks/families_gpu.py --out $OUT/families
