export PYTHONUNBUFFERED=1 PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 MEGATRAIN_GIT_COMMIT=$(cat .commit 2>/dev/null)
nproc; grep -m1 "model name" /proc/cpuinfo; grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -c avx512
python -m kernels.host_adamw
python experiments/host_adam_bench.py --params 256 --reps 21 --systems megatrain_jax_fused_kernel_fp32,torch_fused_cpu_adamw \
  --kernel-variants 'c64k:MEGATRAIN_CHUNK=65536|c1m:MEGATRAIN_CHUNK=1048576|s2:MEGATRAIN_SPLIT=2|s4:MEGATRAIN_SPLIT=4|t0:MEGATRAIN_PREFETCH_HINT=3|c64ks2:MEGATRAIN_CHUNK=65536,MEGATRAIN_SPLIT=2' \
  --out $OUT/h100_host_adamw_v7_variants.json
python experiments/host_adam_bench.py --params 256 --reps 21 --systems torch_fused_cpu_adamw \
  --kernel-variants 'bind:MEGATRAIN_BIND=1|bindc64k:MEGATRAIN_BIND=1,MEGATRAIN_CHUNK=65536|binds2:MEGATRAIN_BIND=1,MEGATRAIN_SPLIT=2' \
  --out $OUT/h100_host_adamw_v7_bind.json
