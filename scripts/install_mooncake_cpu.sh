#!/usr/bin/env bash
# OPTIONAL, benchmark only: install Mooncake's transfer engine into a CPU venv, idempotently, so
# that the `sglang-mooncake-tcp` row of benchmarks/handoff.py can run (SGLang's own `mooncake`
# transfer backend over TCP). Not part of `make env` / `make test`; nothing in splitserve or its
# tests needs it.
#
# usage: scripts/install_mooncake_cpu.sh VENV_DIR
#
# VENV_DIR must already hold SGLang (scripts/install_sglang_cpu.sh). What it does:
#   1. pip-installs mooncake-transfer-engine-non-cuda (pinned, cp311 manylinux wheel) into the
#      venv.
#   2. The wheel's engine.so links libibverbs.so.1 even when only TCP is used, and libibverbs
#      needs libnl. Where the system lacks them, their Debian packages are fetched with
#      `apt-get download` (no root, nothing installed system-wide) and unpacked with `dpkg -x`
#      into VENV_DIR/opt/mooncake-deps; the shared libraries are gathered in
#      VENV_DIR/opt/mooncake-deps/lib.
#   3. Checks `from mooncake.engine import TransferEngine` with that directory on
#      LD_LIBRARY_PATH, and prints the LD_LIBRARY_PATH to use. benchmarks/handoff_sglang.py adds
#      VENV/opt/mooncake-deps/lib to its SGLang servers' LD_LIBRARY_PATH when it exists.
# Idempotence: VENV_DIR/.splitserve-mooncake-stamp holds a hash of this script; same hash and a
# working import, no work. To undo: pip uninstall mooncake-transfer-engine-non-cuda, then remove
# VENV_DIR/opt/mooncake-deps and the stamp.
set -euo pipefail

MOONCAKE_PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"

fail() {
    echo "install_mooncake_cpu: ERROR: $1" >&2
    [ $# -gt 1 ] && echo "install_mooncake_cpu: what to do: $2" >&2
    exit 1
}

[ $# -eq 1 ] || fail "expected one argument, VENV_DIR (got $#)" \
    "run: scripts/install_mooncake_cpu.sh /path/to/venv"
VENV=$(cd "$1" 2>/dev/null && pwd) || fail "VENV_DIR '$1' does not exist" \
    "pass the CPU venv that scripts/install_sglang_cpu.sh set up"
PY="$VENV/bin/python"
[ -x "$PY" ] || fail "$PY is not an executable Python" "pass the venv's root folder"
STAMP="$VENV/.splitserve-mooncake-stamp"
DEPS="$VENV/opt/mooncake-deps"
LIB="$DEPS/lib"

smoke() {
    LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PY" -c \
        "from mooncake.engine import TransferEngine; TransferEngine()"
}

done_msg() {
    echo "install_mooncake_cpu: $1"
    echo "install_mooncake_cpu: to use it outside the benchmark: export LD_LIBRARY_PATH=$LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
}

KEY=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && smoke >/dev/null 2>&1; then
    done_msg "$VENV is up to date, nothing to install"
    exit 0
fi
rm -f "$STAMP"

"$PY" -c "import sglang" 2>/dev/null || fail "$VENV has no SGLang" \
    "run scripts/install_sglang_cpu.sh $VENV first"

# 1.
echo "install_mooncake_cpu: installing $MOONCAKE_PIN into $VENV"
"$PY" -m pip --disable-pip-version-check -q install "$MOONCAKE_PIN" \
    || fail "pip could not install $MOONCAKE_PIN" \
        "read pip's error above (the wheel is cp310+/manylinux_2_28 x86_64 only)"
ENGINE=$("$PY" -c "import importlib.util as u, os; print(os.path.join(u.find_spec('mooncake').submodule_search_locations[0], 'engine.so'))") \
    || fail "the mooncake package does not import after pip install" "read the traceback above"
[ -f "$ENGINE" ] || fail "$ENGINE is missing from the installed wheel" \
    "reinstall: $PY -m pip install --force-reinstall $MOONCAKE_PIN"

# 2. Missing shared libraries -> Debian packages (those Mooncake's TCP path needs are known;
#    another missing library stops with its name).
package_of() {
    case "$1" in
        libibverbs.so.1) echo libibverbs1 ;;
        libnl-3.so.200) echo libnl-3-200 ;;
        libnl-route-3.so.200) echo libnl-route-3-200 ;;
        *) return 1 ;;
    esac
}
missing() {  # libraries ldd cannot find for engine.so and what is already in $LIB
    local files=("$ENGINE")
    [ -d "$LIB" ] && mapfile -t -O 1 files < <(find "$LIB" -name '*.so*' -type f)
    for f in "${files[@]}"; do
        LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$f" 2>/dev/null \
            | awk '/not found/ {print $1}'
    done | sort -u
}
command -v ldd >/dev/null || fail "ldd is not available" "install libc-bin (it is part of glibc)"
mkdir -p "$LIB" "$DEPS/debs" "$DEPS/root"
for round in 1 2 3 4; do
    mapfile -t libs < <(missing)
    [ ${#libs[@]} -eq 0 ] && break
    [ "$round" -eq 4 ] && fail "still missing after 3 rounds: ${libs[*]}" \
        "install them system-wide (apt-get install libibverbs1), or report this"
    for lib in "${libs[@]}"; do
        pkg=$(package_of "$lib") || fail "engine.so needs $lib, which this script cannot map to a package" \
            "find its package (apt-file search $lib) and add it to package_of() in $0"
        echo "install_mooncake_cpu: $lib missing: fetching Debian package $pkg"
        command -v apt-get >/dev/null && command -v dpkg >/dev/null \
            || fail "apt-get/dpkg are not available to fetch $pkg" \
                "install $pkg (for $lib) with the system's package manager, then rerun"
        # apt-get download writes to the current directory; as root it warns that _apt cannot
        # write there (harmless).
        (cd "$DEPS/debs" && rm -f "${pkg}"_*.deb && apt-get download "$pkg" >/dev/null 2>"$DEPS/debs/apt.err") \
            || fail "apt-get download $pkg failed: $(tail -n 3 "$DEPS/debs/apt.err")" \
                "run 'apt-get update' (no root needed for download only if the lists exist), or install $pkg system-wide"
        deb=$(ls "$DEPS/debs/${pkg}"_*.deb 2>/dev/null | head -n 1)
        [ -n "$deb" ] || fail "apt-get download $pkg produced no .deb" "read $DEPS/debs/apt.err"
        dpkg -x "$deb" "$DEPS/root" || fail "dpkg -x $deb failed" "delete $DEPS and rerun"
    done
    # gather the unpacked libraries (files and their SONAME links) in one directory
    find "$DEPS/root" \( -type f -o -type l \) -name '*.so*' -path '*/lib/*' -exec cp -a {} "$LIB/" \;
done

# 3.
smoke || fail "from mooncake.engine import TransferEngine fails (traceback above)" \
    "check 'LD_LIBRARY_PATH=$LIB ldd $ENGINE' for libraries still missing"
echo "$KEY" > "$STAMP"
done_msg "$VENV ready ($MOONCAKE_PIN; libraries in $LIB)"
