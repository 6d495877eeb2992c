#!/usr/bin/env bash
# Carry Python packages the GPU machine lacks (it has no package registry) beside the checkout:
# `cute`, the CuTe DSL (nvidia-cutlass-dsl, for research/cute_probe.py), or `triton`, Triton
# 3.9 (to run epifuse on it instead of the machine's 3.6; without its AMD backend, profiler
# and Blackwell ptxas). A call carries 64 MiB with the checkout and each packs to 66-104 MB, so
# it goes in two halves, in two calls made back to back on one warm machine. Run from the
# checkout.
#
#   bash research/carry.sh pack PKG       # here: fills .PKG1/ and .PKG2/ (git-ignored)
#   bash research/carry.sh first PKG      # GPU, first call, carry .PKG1
#   source research/carry.sh second PKG   # GPU, second call, carry .PKG2; sets PYTHONPATH
#                                         # (and for triton the variables its loader needs)
# Sourced, it changes nothing in the caller's shell but those variables, and fails with a
# return code.

_carry_wheels() {  # the wheels of PKG for the GPU machine's Python 3.12, unpacked into $2
  local pkg=$1 site=$2 work
  work=$(mktemp -d)
  case "$pkg" in
    cute) local v=4.8.1
      pip download -q --no-deps -d "$work" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "nvidia-cutlass-dsl==$v" "nvidia-cutlass-dsl-libs-base==$v" \
        "nvidia-cutlass-dsl-libs-core==$v" "nvidia-cutlass-dsl-libs-cu13==$v" ;;
    triton)
      pip download -q --no-deps -d "$work" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "triton==3.9.0" ;;
  esac
  for wheel in "$work"/*.whl; do unzip -q -o "$wheel" -d "$site"; done
  rm -rf "$work"
  if [ "$pkg" = triton ]; then  # what a CUDA launch on Hopper does not load
    rm -rf "$site"/triton/backends/amd "$site"/triton/backends/nvidia/lib/cupti* \
      "$site"/triton/backends/nvidia/bin/ptxas-blackwell "$site"/triton/_C/libproton.so \
      "$site"/triton/instrumentation "$site"/triton/plugins "$site"/triton/include "$site"/triton/FileCheck
  fi
}

_carry() {
  local step=${1:-} pkg=${2:-}
  case "$step $pkg" in
    "pack cute"|"pack triton"|"first cute"|"first triton"|"second cute"|"second triton") ;;
    *) echo "usage: research/carry.sh pack|first|second cute|triton" >&2; return 2 ;;
  esac
  local site=/tmp/site_$pkg
  case "$step" in
    pack) (
      set -euo pipefail
      cd "$(git rev-parse --show-toplevel)"
      work=$(mktemp -d)
      mkdir -p "$work/site_$pkg"
      _carry_wheels "$pkg" "$work/site_$pkg"
      level=-9e; [ "$pkg" = triton ] && level=-6  # -9e takes minutes on the 500 MB libtriton
      tar -cf - -C "$work" "site_$pkg" | xz -T2 "$level" > "$work/site.tar.xz"
      split -n 2 "$work/site.tar.xz" "$work/part."
      test "$(ls "$work"/part.* | wc -l)" -eq 2
      rm -rf ".${pkg}1" ".${pkg}2" && mkdir -p ".${pkg}1" ".${pkg}2"
      mv "$work/part.aa" ".${pkg}1/" && mv "$work/part.ab" ".${pkg}2/"
      exclude=$(git rev-parse --git-path info/exclude)
      for d in ".${pkg}1" ".${pkg}2"; do grep -qx "/$d/" "$exclude" || echo "/$d/" >> "$exclude"; done
      rm -rf "$work"
      ls -la ".${pkg}1" ".${pkg}2"
      ) ;;
    first)
      cp ".${pkg}1/part.aa" "/tmp/part_$pkg.aa" || return 1
      ;;
    second)
      if [ ! -f "$site.ok" ]; then
        if [ ! -f "/tmp/part_$pkg.aa" ]; then
          echo "carry: no first half in /tmp: a fresh machine; make the first call again" >&2
          return 1
        fi
        rm -rf "$site"
        if ! cat "/tmp/part_$pkg.aa" ".${pkg}2/part.ab" | tar -xJf - -C /tmp; then
          echo "carry: could not unpack (was .${pkg}2 carried?)" >&2
          return 1
        fi
        touch "$site.ok"
      fi
      if [ "$pkg" = cute ]; then
        export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:.:src${PYTHONPATH:+:$PYTHONPATH}"
      else  # the machine's own Triton registers backends (AMD) that this one lacks; 3.9 runs Hopper
            # through ptxas-blackwell, which is left out (its other ptxas compiles sm_90a); and fp
            # fusion set to 3.9's default, which silences its warning that the default will change
        export PYTHONPATH="$site:.:src${PYTHONPATH:+:$PYTHONPATH}" TRITON_BACKENDS_IN_TREE=1 \
          TRITON_PTXAS_BLACKWELL_PATH="$site/triton/backends/nvidia/bin/ptxas" TRITON_DEFAULT_FP_FUSION=1
      fi
      ;;
  esac
}

_carry "$@"
_carry_status=$?
unset -f _carry _carry_wheels
if [ "$_carry_status" -ne 0 ]; then
  unset _carry_status
  return 1 2>/dev/null || exit 1
fi
unset _carry_status
