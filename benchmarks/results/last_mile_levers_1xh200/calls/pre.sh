# sourced by every call: environment, caches, the DeepCompile op built in the background ($BUILD)
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS; W=/tmp/s15; mkdir -p $W $TORCHINDUCTOR_CACHE_DIR
cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
echo "machine: $(ls $TORCHINDUCTOR_CACHE_DIR | wc -l) inductor cache entries, $(ls $W | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > $W/gpus_$CALL.txt 2>&1
(python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build_$CALL.log 2>&1) &
BUILD=$!
# an ablation folder carried in the repo continues there when this machine has none
if [ ! -d $W/ablation ] && [ -d devrun/ablation ]; then cp -r devrun/ablation $W/ablation; echo "continuing devrun/ablation"; fi
