# Stop 51: B4's offline side with and without the frozen startup heap (time in the collector per round), then B4 with 4 and 1 API processes against the frozen offline engine.
source .devrun/setup.sh
mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== offline, 4b4a4a1 (heap not frozen)"
PYTHONPATH=$PWD/bench/.baseline:$PYTHONPATH timeout 120 python .devrun/gc_offline.py 5 2>&1 | grep -v Warn | tail -6 | tee $OUT/gc_offline-base.txt
echo "== offline, $GIT_SHA (frozen)"
timeout 120 python .devrun/gc_offline.py 5 2>&1 | grep -v Warn | tail -6 | tee $OUT/gc_offline-new.txt
show() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rounds']: print(sys.argv[2], round(r['ratio'],3), round(r['server_tokens_per_s']), round(r['offline_tokens_per_s']), round(r['offline_gc_ms']), round(r['server_cpu_ms_per_1k_tokens']['api'],1), round(r['api_busy'],2), r['arrivals'].get('server_ttft_median_ms'))
print(sys.argv[2], 'median', round(d['median_ratio'],3), round(d['median_server_tokens_per_s']), round(d['median_offline_tokens_per_s']))
" $1 $2; }
for run in api4-a api1-a; do
  n=${run#api}; n=${n%%[a-z-]*}
  timeout 130 python bench/server_offline.py --rounds 4 --serve-args=--api-server-count=$n --label $run --out $OUT > $OUT/b4-$run.log 2>&1; show $OUT/server_offline-*-$run.json $run
done
