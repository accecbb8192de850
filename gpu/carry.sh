#!/usr/bin/env bash
# carry.sh - HERE (a machine with pip and a registry): download the pinned GPU stack the H200 device lacks
# (torch 2.13.0 + vLLM 0.32.0 + NCCL 2.29.7 + TRL 1.16 and the rest: ../shared/gpu/wheels-torch2.13-vllm0.32.txt,
# 96 wheels, about 1.3 GB) and lay them out as folders of at most PART_MIB (52) MiB, .whl/p1 ... .whl/pN (ignored by git):
# small wheels whole, big ones split into PART_MIB - 2 MiB pieces (reassembled by gpu/device.sh). Then send the parts back
# to back, one `run` call each (`mkdir -p /tmp/parts && cp -r .whl/pK/* /tmp/parts/`, carry .whl/pK), and run
# gpu/device.sh in the last call.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.whl/all
mkdir -p "$W"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 28 27 26 24 18 17 5 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
names=$(sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/' "${WHEELS_TXT:-../shared/gpu/wheels-torch2.13-vllm0.32.txt}")
# SKIP_DOWNLOAD=1 re-lays out the parts from .whl/all (when the tracked tree grew and a part no longer fits)
[ "${SKIP_DOWNLOAD:-0}" = 1 ] || python3 -m pip download -q --no-deps "${plat[@]}" -d "$W" $names
rm -rf .whl/p* .whl/split && mkdir -p .whl/split
# a part plus the tracked tree must stay under the device's 64 MiB per call: 52 MiB leaves the tree 12
PART_MIB=${PART_MIB:-52}
LIMIT=$((PART_MIB * 1024 * 1024))
for w in "$W"/*.whl; do
  if [ "$(stat -c %s "$w")" -gt "$LIMIT" ]; then split -b "$((PART_MIB - 2))M" -d -a 2 "$w" ".whl/split/$(basename "$w").part."
  else cp "$w" .whl/split/; fi
done
# first-fit into folders of at most PART_MIB (52) MiB, largest first
PART_MIB=$PART_MIB python3 - <<'PY'
import os, shutil
files = sorted(((os.path.getsize(f".whl/split/{f}"), f) for f in os.listdir(".whl/split")), reverse=True)
bins: list[list] = []
for size, f in files:
    for b in bins:
        if b[0] + size <= int(os.environ["PART_MIB"]) * 2**20:
            b[0] += size; b[1].append(f); break
    else:
        bins.append([size, [f]])
for i, (_, fs) in enumerate(bins, 1):
    os.makedirs(f".whl/p{i}")
    for f in fs:
        shutil.move(f".whl/split/{f}", f".whl/p{i}/{f}")
print(f"{len(bins)} parts")
PY
rmdir .whl/split
(cd "$W" && sha256sum *.whl) > .whl/p1/SHA256SUMS
du -sh .whl/p* | tail -3
