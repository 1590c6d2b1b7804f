export PYTHONUNBUFFERED=1 PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 MEGATRAIN_GIT_COMMIT=$(cat .commit 2>/dev/null)
V='c64k:MEGATRAIN_CHUNK=65536|c64ks2:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=2|c16ks2:MEGATRAIN_CHUNK=16384,MEGATRAIN_SPLIT=2|c32ks2:MEGATRAIN_CHUNK=32768,MEGATRAIN_SPLIT=2|c128ks2:MEGATRAIN_CHUNK=131072,MEGATRAIN_SPLIT=2|c256ks2:MEGATRAIN_CHUNK=262144,MEGATRAIN_SPLIT=2|c64ks4:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=4|c64ks2t0:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=2,MEGATRAIN_PREFETCH_HINT=3'
python experiments/host_adam_bench.py --params 256 --reps 21 --systems megatrain_jax_fused_kernel_fp32,torch_fused_cpu_adamw \
  --kernel-variants "$V" --out $OUT/h100_host_adamw_v7_chunks.json
python experiments/host_adam_bench.py --params 256 --reps 21 --systems torch_fused_cpu_adamw,megatrain_jax_fused_kernel_first_half,megatrain_jax_fused_kernel_fp32 \
  --kernel-variants 'c64ks2:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=2|c64ks2fh:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=2,first_half|c32ks2:MEGATRAIN_CHUNK=32768,MEGATRAIN_SPLIT=2' \
  --out $OUT/h100_host_adamw_v7_repeat.json
