# Stop 51 on the H200: the driver query's cost; where B2's small-model step goes (wall vs kernels, py-spy); B4 with 4 API processes (new, base 4b4a4a1) against 1.
source .devrun/setup.sh
mkdir -p $OUT
PYSPY=/tmp/site/bin/py-spy
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -i "model name"
python3 -c "
import torch, time
torch.zeros(1, device='cuda'); torch.cuda.mem_get_info(0)
for _ in range(3):
    t=time.perf_counter(); [torch.cuda.mem_get_info(0) for _ in range(2000)]; a=(time.perf_counter()-t)/2000
    t=time.perf_counter(); [torch.cuda.memory_allocated(0) for _ in range(2000)]; b=(time.perf_counter()-t)/2000
    print(f'mem_get_info {a*1e6:.1f} us, memory_allocated {b*1e6:.2f} us a call')
" | tee $OUT/mem_get_info.txt
timeout 120 python bench/gpu_suite.py profile_b2 --no-transformers --out $OUT > $OUT/profile_b2.log 2>&1; head -1 $OUT/profile_b2_decode.txt
timeout 150 $PYSPY record -r 250 --idle -f raw -o $OUT/b2-spy.raw -- python bench/gpu_suite.py b2 --b2-models qwen3_0.6b --no-transformers --out $OUT > $OUT/b2.log 2>&1; grep "^B2" $OUT/b2.log
python3 - $OUT/b2-spy.raw > $OUT/b2-spy-top.txt <<'PY'
import collections, sys
incl = collections.Counter(); self_ = collections.Counter(); tot = 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    if not any("run_traced" in f for f in frames): continue
    tot += n; self_[frames[-1]] += n
    for f in set(frames): incl[f] += n
print("samples in run_traced", tot)
for f, n in incl.most_common(90): print(f"{100*n/tot:5.1f} incl {f[:170]}")
print()
for f, n in self_.most_common(40): print(f"{100*n/tot:5.1f} self {f[:170]}")
PY
gzip $OUT/b2-spy.raw
head -45 $OUT/b2-spy-top.txt | cut -c1-150
show() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rounds']: print(sys.argv[2], round(r['ratio'],3), round(r['server_tokens_per_s']), round(r['offline_tokens_per_s']), round(r['server_cpu_ms_per_1k_tokens']['api'],1), round(r['api_busy'],2))
print(sys.argv[2], 'median', round(d['median_ratio'],3))
" $1 $2; }
for run in api4-a api1-a api4base-a; do
  n=${run#api}; n=${n%%[a-z-]*}; pkg=.; case $run in *base*) pkg=bench/.baseline;; esac
  timeout 110 python bench/server_offline.py --rounds 3 --package $pkg --serve-args=--api-server-count=$n --label $run --out $OUT > $OUT/b4-$run.log 2>&1; show $OUT/server_offline-*-$run.json $run
done
