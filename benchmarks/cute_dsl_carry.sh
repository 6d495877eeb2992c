#!/usr/bin/env bash
# Carry the CuTe DSL (nvidia-cutlass-dsl, for benchmarks/cute_probe.py) to the GPU machine, which
# has no package registry. A call carries 64 MiB with the checkout; the DSL packs to 66 MB, so it
# goes in two halves, in two calls made back to back on one warm machine. Run from the checkout.
#
#   bash benchmarks/cute_dsl_carry.sh pack              # here: fills .cute1/ and .cute2/ (git-ignored)
#   bash benchmarks/cute_dsl_carry.sh first             # GPU, first call, carry .cute1
#   source benchmarks/cute_dsl_carry.sh second          # GPU, second call, carry .cute2; sets PYTHONPATH
# Sourced, it changes nothing in the caller's shell but PYTHONPATH, and fails with a return code.

_cute_dsl_carry() {
  local version=4.8.1 site=/tmp/site312
  case "${1:-}" in
    pack) (
      set -euo pipefail
      cd "$(git rev-parse --show-toplevel)"
      work=$(mktemp -d)
      pip download -q --no-deps -d "$work/wheels" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "nvidia-cutlass-dsl==$version" \
        "nvidia-cutlass-dsl-libs-base==$version" "nvidia-cutlass-dsl-libs-core==$version" \
        "nvidia-cutlass-dsl-libs-cu13==$version"
      mkdir -p "$work/site312"
      for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site312"; done
      tar -cf - -C "$work" site312 | xz -T2 -9e > "$work/site312.tar.xz"
      split -n 2 "$work/site312.tar.xz" "$work/part."
      test "$(ls "$work"/part.* | wc -l)" -eq 2
      rm -rf .cute1 .cute2 && mkdir -p .cute1 .cute2
      mv "$work/part.aa" .cute1/ && mv "$work/part.ab" .cute2/
      exclude=$(git rev-parse --git-path info/exclude)
      for d in .cute1 .cute2; do grep -qx "/$d/" "$exclude" || echo "/$d/" >> "$exclude"; done
      rm -rf "$work"
      ls -la .cute1 .cute2
      ) ;;
    first)
      cp .cute1/part.aa /tmp/ || return 1
      ;;
    second)
      if [ ! -f "$site.ok" ]; then
        if [ ! -f /tmp/part.aa ]; then
          echo "cute_dsl_carry: no first half in /tmp: a fresh machine; make the first call again" >&2
          return 1
        fi
        rm -rf "$site"
        if ! cat /tmp/part.aa .cute2/part.ab | tar -xJf - -C /tmp; then
          echo "cute_dsl_carry: could not unpack (was .cute2 carried?)" >&2
          return 1
        fi
        touch "$site.ok"
      fi
      export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:.:src${PYTHONPATH:+:$PYTHONPATH}"
      ;;
    *)
      echo "usage: benchmarks/cute_dsl_carry.sh pack | first | second" >&2
      return 2
      ;;
  esac
}

_cute_dsl_carry "$@"
_cute_dsl_carry_status=$?
unset -f _cute_dsl_carry
if [ "$_cute_dsl_carry_status" -ne 0 ]; then
  unset _cute_dsl_carry_status
  return 1 2>/dev/null || exit 1
fi
unset _cute_dsl_carry_status
