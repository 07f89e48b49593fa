out=$OUT; source scripts/device-env.sh; device_env || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 models/export_panel.py --out /tmp/panel --models rrdb_sr,vae_decoder,ecaresnet50d > $OUT/export.log 2>&1 || tail -5 $OUT/export.log
timeout 240 python3 benchmarks/conv_gap.py --panel /tmp/panel --models rrdb_sr,vae_decoder,ecaresnet50d --batch 16 --cache /tmp/gapcache --json $OUT/gap.json > $OUT/gap.txt 2>&1; echo "gap rc $?"
grep -iE "model|total|conv time|in place|tuned|torch" $OUT/gap.txt | head -40
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cli_gpu.py tests/gpu/test_cold_start.py tests/gpu/test_in_place_gpu.py tests/gpu/test_fusions_gpu.py > $OUT/gpu.txt 2>&1; echo "gpu rc $?"
tail -25 $OUT/gpu.txt
