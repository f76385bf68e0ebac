#!/usr/bin/env bash
# Prints the path of a CPython 3.13 that runs (it imports ssl, sqlite3, lzma, bz2, ctypes and venv), for the ceiling
# venv (.ci/ceiling.sh). In order: one the machine holds (on PATH, or beside the default python3: pyenv's versions,
# /usr/bin, /usr/local/bin), Debian's python3.13 package where apt has one (Debian 13), else one built from Debian 13's
# source package into "$FLAX_LN_PYTHON_CACHE/<version>" (default ~/.cache/flax-ln/python), outside the clone, reused
# by later runs after the same check (rebuilt when it fails it).
# FLAX_LN_BUILD_PYTHON=1 skips the first two, so the build (or its reuse) can be timed. Progress goes to stderr.
set -euo pipefail
say() { echo "python313: $*" >&2; }
CHECK='import sys, ssl, sqlite3, lzma, bz2, ctypes, venv; sys.exit(sys.version_info[:2] != (3, 13))'
works() { [ -x "$1" ] && "$1" -c "$CHECK" >/dev/null 2>&1; }
CACHE="${FLAX_LN_PYTHON_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flax-ln/python}"

if [ "${FLAX_LN_BUILD_PYTHON:-0}" != 1 ]; then
  default_prefix="$(python3 -c 'import sys; print(sys.base_prefix)' 2>/dev/null || true)"
  for candidate in "$(command -v python3.13 || true)" "${default_prefix%/*}"/*/bin/python3.13 \
    /usr/bin/python3.13 /usr/local/bin/python3.13; do
    if [ -n "$candidate" ] && works "$candidate"; then
      say "the machine's $candidate"
      echo "$candidate"
      exit 0
    fi
  done
  # Debian 13 packages 3.13 (the venv module apart); an older Debian has no candidate and says so at once
  if command -v apt-cache >/dev/null && apt-cache policy python3.13 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    say "installing Debian's python3.13"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.13 python3.13-venv >/dev/null
    if works /usr/bin/python3.13; then echo /usr/bin/python3.13; exit 0; fi
  fi
fi

for built in "$CACHE"/3.13.*/bin/python3.13; do
  if works "$built"; then
    say "reusing the build $built"
    echo "$built"
    exit 0
  fi
  if [ -e "$built" ]; then
    say "the build $built fails the check: building again"
    rm -rf "${built%/bin/python3.13}"
  fi
done

# Build from Debian 13's source package. A private apt configuration (its own source list and package lists, a
# deb-src line on the machine's own Debian mirror) leaves the system's sources alone. Debian's own tree disables
# ensurepip and changes the install layout, so the upstream tarball (.orig.tar.xz) is built, not the unpacked tree.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mirror="$(grep -hoE '^(URIs:|deb) *https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
  2>/dev/null | grep -oE 'https?://[^ ]+' | head -n 1 || true)"
mirror="${mirror:-http://deb.debian.org/debian}"
say "downloading Debian 13's python3.13 source package from $mirror"
mkdir -p "$work/lists/partial" "$work/src"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} trixie main" >"$work/sources.list"
APT=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/dev/null -o "Dir::State::Lists=$work/lists"
  -o APT::Sandbox::User=root)   # the private folders are root's: no download sandbox user to hand them to
apt-get "${APT[@]}" -qq update || apt-get "${APT[@]}" -qq update   # the registry retried once
(cd "$work/src" && { apt-get "${APT[@]}" -qq source --download-only python3.13 >/dev/null ||
  apt-get "${APT[@]}" -qq source --download-only python3.13 >/dev/null; })
orig="$(ls "$work"/src/python3.13_*.orig.tar.xz | head -n 1)"
version="$(basename "$orig" | sed -E 's/^python3\.13_(3\.13\.[0-9]+).*$/\1/')"   # python3.13_3.13.5.orig.tar.xz
say "building CPython $version (upstream source) with $(nproc) jobs"
packages=(gcc make libssl-dev libsqlite3-dev liblzma-dev libbz2-dev libffi-dev zlib1g-dev libreadline-dev uuid-dev)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
tar -xJf "$orig" -C "$work"
prefix="$CACHE/$version"
cd "$work"/Python-*/
./configure --prefix="$prefix" --with-ensurepip=install >"$work/configure.log" 2>&1 ||
  { tail -n 30 "$work/configure.log" >&2; exit 1; }
make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
make install DESTDIR="$work/stage" >"$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; exit 1; }
# checked where it was staged, then moved into place in one rename (beside it, on the same file system)
works "$work/stage$prefix/bin/python3.13" || { echo "python313: the built $version fails: $CHECK" >&2; exit 1; }
mkdir -p "$CACHE"
staged="$(mktemp -d "$CACHE/.staging-XXXXXX")"
mv "$work/stage$prefix" "$staged/$version"
mv -T "$staged/$version" "$prefix" && rmdir "$staged"
works "$prefix/bin/python3.13" || { echo "python313: the installed $prefix fails: $CHECK" >&2; exit 1; }
say "built $prefix"
echo "$prefix/bin/python3.13"
