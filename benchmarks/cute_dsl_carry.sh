#!/usr/bin/env bash
# Carry the CuTe DSL (nvidia-cutlass-dsl, for benchmarks/cute_probe.py) to the GPU machine, which
# has no package registry. A call carries 64 MiB with the checkout; the DSL packs to 66 MB, so it
# goes in two halves, in two calls made back to back on one warm machine.
#
#   bash benchmarks/cute_dsl_carry.sh pack              # here: fills .cute1/ and .cute2/ (git-ignored)
#   bash benchmarks/cute_dsl_carry.sh first             # GPU, first call, carry .cute1
#   source benchmarks/cute_dsl_carry.sh second          # GPU, second call, carry .cute2; sets PYTHONPATH
VERSION=4.8.1
SITE=/tmp/site312
case "${1:-}" in
  pack) (
    set -euo pipefail
    work=$(mktemp -d)
    pip download -q --no-deps -d "$work/wheels" --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 "nvidia-cutlass-dsl==$VERSION" \
      "nvidia-cutlass-dsl-libs-base==$VERSION" "nvidia-cutlass-dsl-libs-core==$VERSION" \
      "nvidia-cutlass-dsl-libs-cu13==$VERSION"
    mkdir -p "$work/site312"
    for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site312"; done
    tar -cf - -C "$work" site312 | xz -T2 -9e > "$work/site312.tar.xz"
    rm -rf .cute1 .cute2 && mkdir -p .cute1 .cute2
    split -b 33000000 "$work/site312.tar.xz" "$work/part."
    mv "$work/part.aa" .cute1/ && mv "$work/part.ab" .cute2/
    for d in .cute1 .cute2; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
    rm -rf "$work"
    ls -la .cute1 .cute2
    ) ;;
  first)
    cp .cute1/part.aa /tmp/
    ;;
  second)
    if [ ! -f "$SITE.ok" ]; then
      test -f /tmp/part.aa || { echo "no first half in /tmp: this is a fresh machine, make the first call again" >&2; return 1 2>/dev/null || exit 1; }
      rm -rf "$SITE"
      cat /tmp/part.aa .cute2/part.ab | tar -xJf - -C /tmp && touch "$SITE.ok"
    fi
    export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:.:src${PYTHONPATH:+:$PYTHONPATH}"
    ;;
  *)
    echo "usage: $0 pack | first | second" >&2
    exit 2
    ;;
esac
