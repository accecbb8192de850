#!/usr/bin/env bash
# carry.sh - HERE (a machine with pip and a registry): download the wheels the H200 device lacks (vLLM 0.26.0,
# the release pinned to the device's torch 2.11, its 75 small dependencies from ../shared/gpu/wheels.txt,
# and TRL, datasets, transformers, accelerate, submitit with their missing dependencies), unzip them into two
# trees (vLLM, the rest), compress each with zstd --long and split into 24 MiB parts, one folder each:
# .whl/p1 ... .whl/pN (ignored by git; p1 also carries zstd, which the device lacks). Then send the parts
# back to back, one `run` call each (`cp -r .whl/pK/* /tmp/parts/`), and run gpu/device.sh in the last call.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.whl/all
mkdir -p "$W"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 28 27 26 24 17 5 31; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
names=$(sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/' "${WHEELS_TXT:-../shared/gpu/wheels.txt}")
python3 -m pip download -q --no-deps "${plat[@]}" -d "$W" $names trl==1.16.0 datasets==5.2.0 submitit==1.5.4 \
  transformers==5.19.0 accelerate==1.16.0 "dill<0.4.2,>=0.3.0" "multiprocess<0.70.20"
# unzip every wheel into one tree (what pip --no-deps --target would make), compress with zstd --long
# (about 30% smaller than the wheels' own zip) and split into 24 MiB parts: a small part uploads fast
# enough that the device machine does not go idle (30 s) between the back-to-back calls
rm -rf .whl/p* /tmp/carry-d /tmp/carry-v && mkdir -p /tmp/carry-d /tmp/carry-v
for w in "$W"/*.whl; do case $w in */vllm-*) unzip -q -o "$w" -d /tmp/carry-v;; *) unzip -q -o "$w" -d /tmp/carry-d;; esac; done
tar -cf - -C /tmp/carry-d . | zstd -T0 -12 --long=27 -q -o .whl/d.tar.zst
tar -cf - -C /tmp/carry-v . | zstd -T0 -19 --long=27 -q -o .whl/v.tar.zst  # the slow part: about 5 min on 2 cores
split -b 24M -d -a 2 .whl/d.tar.zst .whl/d. && split -b 24M -d -a 2 .whl/v.tar.zst .whl/v.
rm .whl/*.tar.zst
i=1
for f in .whl/d.* .whl/v.*; do mkdir -p ".whl/p$i" && mv "$f" ".whl/p$i/"; i=$((i + 1)); done
mkdir -p .whl/p1/bin && cp /usr/bin/zstd .whl/p1/bin/ && cp -L "$(ldconfig -p | awk '/liblz4.so.1 /{print $NF; exit}')" .whl/p1/bin/
ls -d .whl/p* && du -sh .whl/p*
