# Sourced by the device scripts (bash scripts/X.sh on the device machine, shared/device/README.md):
# installs convpass from this tree without the registry, unpacks nvidia-cudnn-frontend when it is
# staged in .cudnnfe/ (cuDNN's graph-API engines, issue 12), and points Python at what was staged
# in /tmp: the frontend (/tmp/cudnnfe-site), onnxruntime-gpu (/tmp/ortgpu), Ray (/tmp/site).
# Wheels carried in .whl/ (jsonschema and its dependencies: the device image has no jsonschema,
# which convpass requires) are installed into /tmp/site when jsonschema cannot be imported.
# Expects $out (the calling script's log folder). Returns non-zero with the install log on failure.
device_env() {
  export PYTHONUNBUFFERED=1
  # measure as an installed environment runs: the device image sets PYTHONDONTWRITEBYTECODE and its
  # site-packages hold no bytecode, so every process would compile what it imports (README, "Tuning
  # time and the cached re-run as an installed environment runs them")
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc}
  if [ -f .cudnnfe/00/part ] && [ ! -d /tmp/cudnnfe-site ]; then
    mkdir -p /tmp/cudnnfe-wheels
    cat .cudnnfe/[0-9]*/part | .cudnnfe/tool/zstd -d -q | tar xf - -C /tmp/cudnnfe-wheels
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/cudnnfe-site /tmp/cudnnfe-wheels/*.whl \
        >"$out/install.log" 2>&1 || { cat "$out/install.log"; rm -rf /tmp/cudnnfe-site; return 1; }
  fi
  # convpass's own pure-Python needs that the device image lacks (jsonschema and its dependencies),
  # carried as wheels in .whl/ (the device tool's README says how to download wheels for it)
  if compgen -G ".whl/*.whl" >/dev/null && ! python3 -c "import jsonschema" 2>/dev/null && [ ! -d /tmp/site/jsonschema ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$out/install.log" 2>&1 || { cat "$out/install.log"; return 1; }
  fi
  local p
  for p in /tmp/site /tmp/ortgpu /tmp/cudnnfe-site; do
    [ -d "$p" ] && export PYTHONPATH=$p${PYTHONPATH:+:$PYTHONPATH}
  done
  local sp=/opt/torch/.venv/lib/python3.12/site-packages
  export LD_LIBRARY_PATH=$sp/nvidia/cu13/lib:$sp/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # always: run from the repository root, "import convpass" finds the folder even when uninstalled,
  # and convpass.compiler.passes exists only through the install's package mapping
  python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$out/install.log" 2>&1 \
    || { cat "$out/install.log"; return 1; }
}
