# Sourced by the set-up scripts: find_python prints a Python >= 3.12 (megatron-core >= 0.17 needs
# it), or returns 1 if there is none.
supports_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    # PATH first, 3.12 preferred (what megatron-core and the GPU images use). A pyenv shim for a
    # version that is not selected fails here and is skipped.
    local candidate
    for candidate in python3.12 python3.13 python3.14 python3 python; do
        if command -v "$candidate" >/dev/null && supports_312 "$(command -v "$candidate")"; then
            command -v "$candidate"
            return
        fi
    done
    # Then the Pythons that pyenv has installed, oldest first: the first >= 3.12 wins.
    if command -v pyenv >/dev/null; then
        for candidate in $(ls -d "$(pyenv root)"/versions/3.*/bin/python3 2>/dev/null | sort -V); do
            if supports_312 "$candidate"; then
                echo "$candidate"
                return
            fi
        done
    fi
    return 1
}
