#!/usr/bin/env bash
# Build kernels_ptx/*.cu (or the .cu files named as arguments) to the .ptx beside each: the committed PTX
# that gpu.py loads, so running the engine needs no compiler. `*_sm90a.cu` (wgmma and other sm_90a-only
# code) is built for compute_90a, everything else for sm_90. Each PTX is then assembled by ptxas for its
# real target (cubin in a temp dir, not committed) to catch errors and print registers / spills / shared
# memory per kernel. No -lineinfo: its .file lines would put this machine's paths into the committed PTX.
# A .cu that fails to compile leaves its old .ptx untouched; the script exits non-zero at the end.
#   kernels_ptx/build.sh                  # all
#   kernels_ptx/build.sh elementwise.cu   # one
set -u
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
PTXAS=${PTXAS:-ptxas}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=()
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(*.cu)

for cu in "${files[@]}"; do
    name=$(basename "${cu%.cu}")
    case "$name" in *_sm90a) arch=sm_90a ;; *) arch=sm_90 ;; esac
    if ! "$NVCC" -ptx -arch="$arch" -O3 -std=c++17 -o "$tmp/$name.ptx" "$name.cu"; then
        failed+=("$name.cu"); continue
    fi
    if ! "$PTXAS" -arch="$arch" -O3 -v -o "$tmp/$name.cubin" "$tmp/$name.ptx" 2>"$tmp/$name.log"; then
        cat "$tmp/$name.log"; failed+=("$name.cu (ptxas)"); continue
    fi
    mv "$tmp/$name.ptx" "$name.ptx"
    echo "== $name.cu -> $name.ptx ($arch)"
    # ptxas -v prints, per kernel: "Compiling entry function 'f'", "N bytes stack frame, S bytes spill stores,
    # L bytes spill loads", "Used R registers, ... B bytes smem". One line each here.
    awk '/Compiling entry function/ { if (f) print line; match($0, /'"'"'[^'"'"']+'"'"'/); f = substr($0, RSTART+1, RLENGTH-2); line = sprintf("   %-28s", f) }
         /stack frame/ { match($0, /[0-9]+ bytes stack frame/); st = substr($0, RSTART, RLENGTH)
                          match($0, /[0-9]+ bytes spill stores/); ss = substr($0, RSTART, RLENGTH)
                          match($0, /[0-9]+ bytes spill loads/); sl = substr($0, RSTART, RLENGTH)
                          line = line sprintf(" %s, %s, %s", st, ss, sl) }
         /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); r = substr($0, RSTART+5, RLENGTH-5)
                          sm = ""; if (match($0, /[0-9]+ bytes smem/)) sm = substr($0, RSTART, RLENGTH)
                          line = line sprintf(" | %s %s", r, sm) }
         END { if (f) print line }' "$tmp/$name.log"
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
