# Stop 51: B4 with each side's device-busy fraction and steps per round (4 API processes, then 1); B2 small model if time.
source .devrun/setup.sh
mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
show() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
print('run ratio server offline offline_gc_ms api_ms/1k api_busy | busy: offline server | steps: offline server | ttft')
for r in d['rounds']: print(sys.argv[2], round(r['ratio'],3), round(r['server_tokens_per_s']), round(r['offline_tokens_per_s']), round(r['offline_gc_ms']), round(r['server_cpu_ms_per_1k_tokens']['api'],1), round(r['api_busy'],2), '|', round(r['offline_device_busy'],3), round(r['server_device_busy'],3), '|', r['offline_steps'], r['server_steps'], '|', r['arrivals'].get('server_ttft_median_ms'))
print(sys.argv[2], 'median', round(d['median_ratio'],3), round(d['median_server_tokens_per_s']), round(d['median_offline_tokens_per_s']))
" $1 $2; }
for run in api4-a api1-a; do
  n=${run#api}; n=${n%%[a-z-]*}
  timeout 140 python bench/server_offline.py --rounds 4 --serve-args=--api-server-count=$n --label $run --out $OUT > $OUT/b4-$run.log 2>&1; show $OUT/server_offline-*-$run.json $run || tail -20 $OUT/b4-$run.log
done
timeout 100 python bench/gpu_suite.py b2 --b2-models qwen3_0.6b --no-transformers --out $OUT > $OUT/b2.log 2>&1; grep "^B2" $OUT/b2.log
