set -x
nvidia-smi --query-gpu=uuid,name,clocks.sm,clocks.max.sm --format=csv,noheader,nounits
python -c "import matplotlib; print('mpl', matplotlib.__version__)"
(time PYTHONPATH=src:. timeout 200 python -m benchmarks --quick --with-s4 --out $OUT/real) > $OUT/real.log 2>&1; echo rc=$?
tail -30 $OUT/real.log
(time PYTHONPATH=benchmarks/_devtmp/mock:. timeout 330 python -m benchmarks --quick --workloads bias_gelu,bce_loss,rowsumsq,fp8_scaled,relu_aux --baselines cublas,eager,cublaslt,inductor,epifuse --prealloc --out $OUT/mock) > $OUT/mock.log 2>&1; echo rc=$?
tail -40 $OUT/mock.log
ls -la $OUT/*
