#!/bin/sh
# On the lent GPU machine: install one set built by tests/gpu/carry.py (see its docstring).
#   sh tests/gpu/install.sh .whl/gpu/sglang-a   # SGLang's sets -> /tmp/sgl (SGLang's interpreter only)
#   sh tests/gpu/install.sh .whl/gpu/tools      # pydantic, pytest -> /tmp/site (the project's processes)
#   sh tests/gpu/install.sh .whl/gpu/trl        # TRL, datasets -> /tmp/site (bench/grpo_vs_trl.py, time_to_accuracy.py)
# Writes /tmp/sgl-python: the interpreter a recipe names as rollout.engine.python there.
set -eu
set_dir=${1:?usage: install.sh WHEEL_SET_DIR}
case "$(basename "$set_dir")" in
  sglang-*) target=/tmp/sgl ;;
  *) target=/tmp/site ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$set_dir"/*.whl
# pip --target leaves Ray's own executables without their mode bits
if [ -d "$target/ray/core/src" ]; then find "$target/ray/core/src" -type f \( -name gcs_server -o -name raylet \) -exec chmod +x {} +; fi
cat >/tmp/sgl-python <<'EOF'
#!/bin/sh
# SGLang 0.5.17 with its own pins; its kernel wheel lacks FA3 (triton attention backend).
export PYTHONPATH=/tmp/sgl SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
exec python3 "$@"
EOF
chmod +x /tmp/sgl-python
echo "installed $(ls "$set_dir"/*.whl | wc -l) wheels into $target"
