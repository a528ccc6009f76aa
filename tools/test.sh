#!/usr/bin/env bash
# All tests, on every stack: the unit tests, then every notebook run cell by cell by nbval
# with its CPU parameters (prepared by papermill into build/nbval-<stack>).
#
#   bash tools/test.sh                 # the four stacks, side by side
#   bash tools/test.sh --stack cpu     # one stack: cpu (.venv), tpu (.venv-tpu), keras3, colab
#   bash tools/test.sh --stack tpu -k records    # further arguments go to pytest
#
# The legs (environments in tools/env.sh):
#   cpu     the TF engine on the pinned CPU stack: every unit test, every notebook of the seeds'
#           track (notebooks/tf/).
#   tpu     the TF engine with tensorflow-tpu and libtpu, put there by the TF notebooks'
#           install plan (a TPU VM can run it; Colab's TPU runtime no longer ships
#           TensorFlow): what proves that plan and that stack (the plan's dry runs, the
#           doctor, connecting, the simulated pod slice), notebook 00 at eight replicas and
#           01 at two, in bfloat16; the other notebooks and unit tests run on the CPU leg.
#   keras3  the Keras 3 engine on a stack shaped like Kaggle's TPU image (Python 3.12, JAX
#           0.10): its tests at eight devices (a v5e-8), the two-process pod-slice
#           rehearsals, main-track notebooks 00, 01 (its sentence-pair variant) and 10
#           (on Gemma 3, a 2 x 4 mesh) at eight (the rest on the Colab leg; the other
#           variants with tools/run.sh --variants).
#   colab   the Keras 3 engine on a stack shaped like Colab's TPU runtime as it ships
#           (Python 3.13, JAX 0.7.2, Keras 3.13.2 before the install cell, transformers
#           5.15, no TensorFlow, no PyTorch): the main track's notebooks at one device
#           (Colab's free v5e-1; 01 as the teaching page's no-TPU recipe runs it; 03 on
#           ELECTRA, 04 on ViT and a distilled DeiT, 05 on DeBERTa-v3), the decoders'
#           tests (a killed sharded LoRA run's resume on the keras3 leg), and the
#           engine's tests whose outcome this stack decides.
#
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stacks=(cpu tpu keras3 colab)
if [ "${1:-}" = "--stack" ]; then
  stacks=("$2")
  shift 2
fi

leg() {
  local stack="$1"
  shift
  if [ "$stack" = colab ]; then  # it fills the cores the other legs leave idle (below)
    renice -n 19 -p "$BASHPID" > /dev/null
  fi
  export STACK="$stack"
  source tools/env.sh
  rm -rf "build/nbval-$stack" "build/pytest-$stack"
  if is_keras3 "$stack"; then
    keras3_leg "$stack" "$@"
    return
  fi
  if [ "$stack" = tpu ] && [ "${#stacks[@]}" -gt 1 ]; then
    tf_tpu_leg "$@"
    return
  fi
  local extra=()
  # The install-plan dry runs (package_index) and the simulated two-host slice run on the
  # TPU leg (tf_tpu_leg); one stack alone runs everything.
  if both_tf_stacks; then
    extra=(-m "not package_index and not pod_slice")
  fi
  # The runs users make: one replica (Colab's free TPU, one v5e chip; a CPU runtime) and
  # eight (Kaggle's v5e-8), each keeping the global batch of the parameter files (their
  # sizes); the CPU stack in float32, the TPU stack in bfloat16 (every notebook's
  # default). The main job (tools/run.sh) runs the parameter files as written: two
  # replicas, bfloat16. A run of every notebook at eight (--replicas 8) passed on
  # 2026-12-02; here each leg runs a few notebooks at eight, the rest at one.
  #
  # Eight simulated replicas cost tracing more than computing: MirroredStrategy builds the
  # step's graph once per replica, one replica at a time in Python, for every new input
  # shape, where a TPU traces it once. 01's pairs at eight, alone on 2 cores
  # (2026-12-03): first epoch 121 s with four widths, second 11 s. So the notebooks at
  # eight are chosen for what they add and for time: 01 on its sentence-pair variant (the
  # same cells on 3,668 MRPC-like rows; CoLA-like at eight took 183 s alone); 03, 04, 05,
  # 06 and 09 only at one (at eight: 09's pipeline benchmark and profile 12 minutes, 04's
  # training 304 s, 05's XLA table 149 s), and 02 too: in the CI rehearsal of 2026-12-03
  # (1946 s, over the 30 minutes the whole run may take) 02 at eight took 612 s in its
  # two training cells and made its leg the last by six minutes. Its loss scaling is
  # judged for 1, 2 and 8 replicas in tests/test_workshop.py; the loop itself runs at two
  # in the tests and the main job, and at one here. 07 ran at eight on this leg until
  # 2026-12-05 (214 s of its cells in CI); it runs at one now, to make room for the main
  # track's notebooks on the Keras 3 legs. Beside this leg, the TPU leg runs 00 at eight
  # and 01's sentence-pair variant at two.
  local eight=() one=(00 01 02 03 04 05 06 07 09)
  local precision=(--set mixed_bfloat16=false)
  if [ "$stack" = tpu ]; then  # the TPU stack alone
    eight=(00 01_text_classification_fit.pairs) one=(01 02 03 04 05 06 07 09) precision=()
  fi
  local replicas
  for replicas in 8 1; do
    local only=() n
    if [ "$replicas" = 8 ]; then
      [ "${#eight[@]}" -gt 0 ] || continue
      for n in "${eight[@]}"; do only+=(--only "$n"); done
    else
      for n in "${one[@]}"; do only+=(--only "$n"); done
      only+=(--no-variants)
    fi
    python tools/run_notebooks.py --prepare-only --engine tf --out "build/nbval-$stack" \
      "${only[@]}" --replicas "$replicas" "${precision[@]}" || return
  done
  python -m pytest tests "build/nbval-$stack" --nbval-lax --nbval-current-env \
    --nbval-cell-timeout=900 -p no:cacheprovider --basetemp "build/pytest-$stack" --durations=25 \
    "${extra[@]}" "$@"
}

is_keras3() {  # a stack of the Keras 3 engine
  [ "$1" = keras3 ] || [ "$1" = colab ]
}

both_tf_stacks() {
  [[ " ${stacks[*]} " == *" cpu "* && " ${stacks[*]} " == *" tpu "* ]]
}

# The TPU leg beside the CPU leg: what proves the TF engine's install plan for a TPU and
# the stack it makes (tensorflow-tpu 2.20, libtpu, tf-keras): the plans and their dry runs
# against the package index, the doctor, connecting and reconnecting, the simulated
# two-host pod slice (a slice runs this stack), notebook 00 at eight replicas and 01 (its
# sentence-pair variant) at two, in bfloat16. Every other unit test and notebook runs on the
# CPU leg (TensorFlow 2.21), which runs the same TF engine; this leg ran everything until
# 2026-12-04 (866 s of tests, the longest leg), time now given to the Colab leg. 01's pairs
# ran at eight here until 2026-12-05 (223 s of its cells in CI, MirroredStrategy tracing
# its step once per replica), which the Keras 3 legs, the last to end, now take.
tf_tpu_leg() {
  python tools/run_notebooks.py --prepare-only --engine tf --out build/nbval-tpu \
    --only 00 --replicas 8 || return
  python tools/run_notebooks.py --prepare-only --engine tf --out build/nbval-tpu \
    --only 01_text_classification_fit.pairs --replicas 2 || return
  python -m pytest tests/test_runtime.py tests/test_install_plans.py tests/test_cli.py \
    tests/test_doctor.py tests/test_strategy.py tests/test_pod.py build/nbval-tpu \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=900 -p no:cacheprovider \
    --basetemp build/pytest-tpu --durations=15 "$@"
}

# The Keras 3 legs (keras3: Kaggle's image; colab: Colab's). The Colab-shaped leg runs at
# the lowest priority, on what the others leave idle (single-threaded tracing and
# compiling leave a core idle for minutes at a time); the Kaggle-shaped leg, whose unit
# tests and notebooks at eight devices run side by side, at the same priority as the TF
# legs: niced too, it ended last by three to ten minutes, on 12 of the run's 40 CPU
# minutes (CI rehearsal of 2026-12-07: 1,817 s against the CPU leg's 1,203 s). Each leg
# runs the main track at its runtime's device count:
# Kaggle's v5e-8, eight devices: the engine's unit tests (against the TF engine's numbers
# in the fixtures, kills and resumes included), the two-process pod-slice rehearsals on
# loopback, the JAX exercise checks, and notebooks 00, 01 (its sentence-pair variant) and
# 10 (on Gemma 3, a 2 x 4 mesh). Colab's v5e-1, one device: every main-track notebook, the
# no-TPU recipe, the decoders' tests, and the engine's tests that this stack decides.
# The other variants run with tools/run.sh --variants. JAX's persistent compilation cache
# lives for the leg (one notebook's compilations serve another's of the same shapes; the
# Colab-shaped leg's second process keeps its own). A
# kernel that dies mid-cell is reported after 300 s, not after 15 minutes. XLA's CPU pool of
# one thread per simulated device can leave devices waiting for good at an all-reduce: env.sh
# and keras3.devices give it two per device (keras3.simulation_env).
keras3_leg() {
  local stack="$1" more=() notebooks=("build/nbval-$stack") status=0
  shift
  export JAX_COMPILATION_CACHE_DIR="$PWD/build/jax-cache-$stack" PYTHONFAULTHANDLER=1
  cheap_compiles  # tools/env.sh says why
  rm -rf "$JAX_COMPILATION_CACHE_DIR" "build/nbval-$stack-8" "build/pytest-$stack-8"
  local tests=(tests/test_keras3.py tests/test_keras3_packing.py tests/test_runtime.py)
  if [ "$stack" = keras3 ]; then
    more=(tests/test_workshop_jax.py)  # the JAX exercise checks' wrong answers
    # the decoders' tests run on the Colab-shaped leg; the killed sharded LoRA run's resume
    # here only, on Kaggle's stack (a v5e-8's mesh is its case)
    more+=(tests/test_decoders.py::test_a_killed_sharded_lora_run_resumes_to_the_weights_of_one_never_stopped)
    # Of the two pod-slice rehearsals, the one on TFRecord shards (each host reading its
    # own) runs beside the other legs; the in-memory one when this leg runs alone.
    if [ "${#stacks[@]}" -gt 1 ]; then
      more+=(-k "not two_processes_on_loopback")
    fi
    notebooks=()  # Kaggle's v5e-8: three notebooks at eight devices, below
  else  # Colab's v5e-1: every notebook at one device
    python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack" \
      --replicas 1 --no-variants || return
    # notebook 01 at one device on this stack is the no-TPU recipe's run (tests/test_offline.py
    # executes every cell, with the same parameter file): not twice
    rm "build/nbval-$stack/01_text_classification_fit.ipynb" || return
    # The families the main track took last, each in a notebook that takes a checkpoint:
    # 03 on ELECTRA and 05 on DeBERTa-v3 in place of their DistilBERT runs (the same cells;
    # DistilBERT runs in 01 (tests/test_offline.py), 02, 06, 07 and 09 here), and 04 on a
    # distilled DeiT (two heads averaged) beside its ViT. Swin's 04 costs 145 s of CPU
    # here, its compilations mostly (2026-12-07); it runs with tools/run.sh --variants, and
    # the engine's tests hold its logits, loss and step to transformers' on both Keras 3 legs.
    rm "build/nbval-$stack/03_tfrecord_pipeline.ipynb" "build/nbval-$stack/05_xla_rules.ipynb" \
      || return
    local n
    for n in 03_tfrecord_pipeline.electra 04_image_streaming.deit 05_xla_rules.deberta; do
      python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack" \
        --only "$n" --replicas 1 || return
    done
    # Both Keras 3 legs have the same Keras, KerasHub and package: the engine's unit tests
    # run on the Kaggle-shaped leg, and here only those whose outcome this stack's own
    # Python, JAX and transformers decide (JAX's compilations and simulated devices, the
    # tokenizer files transformers 5 writes, image preprocessing without PyTorch, the
    # runtime-specific fixes of refusals, shards and downloads read by its TensorFlow), with
    # the no-TPU recipe, the decoders' tests and every main-track notebook, which run the
    # engine end to end on this stack (02 fuses steps and resumes, 05 counts compilations,
    # 09 runs the input-bound check, all in bfloat16).
    local here="each_width_compiles_once or simulated_devices_run or transformers_5_reads"
    here+=" or image_preprocessing_is_read or this_runtime or predict_classes_scores_every"
    here+=" or corrupt_shard or broken_download"
    # the four families the Keras 3 engine reads with converters or heads of its own, at one
    # device on this stack's JAX (the Kaggle-shaped leg runs every family at eight)
    here+=" or (both_engines_give and (electra or deberta or deit or swin))"
    # the killed sharded LoRA run's resume runs on the Kaggle-shaped leg, whose mesh is its case
    more=(tests/test_offline.py tests/test_decoders.py
      -k "not killed_sharded_lora and (not test_keras3 or ($here))")
  fi
  local beside="" log="build/test-$stack-8.log"
  if [ "$stack" = keras3 ]; then  # beside the unit tests, into a log of its own
    eight_devices_notebooks "$stack" "$@" > "$log" 2>&1 &
    beside=$!
  elif [ "$#" -eq 0 ]; then  # half the notebooks in a second process: the other legs end
    # first, and the notebooks, one kernel at a time, left a core idle for the last ten
    # minutes (with pytest's arguments given, one process runs them all)
    log="build/test-$stack-2.log"
    local book half=() rest=()
    for book in build/nbval-"$stack"/*.ipynb; do
      case "$(basename "$book")" in
        0[2-6]_*) half+=("$book") ;;
        *) rest+=("$book") ;;
      esac
    done
    notebooks=("${rest[@]}")
    other_half "$stack" "${half[@]}" > "$log" 2>&1 &
    beside=$!
  fi
  # Each pytest's status is kept: the leg runs under `(leg) || status=$?` (timed_leg), where
  # bash ignores set -e, so a failing first run would otherwise pass unseen.
  python -m pytest "${tests[@]}" "${more[@]}" "${notebooks[@]}" \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 \
    -p no:cacheprovider --basetemp "build/pytest-$stack" --durations=15 "$@" || status=$?
  if [ -n "$beside" ]; then
    wait "$beside" || status=$?
    echo "=== beside it ($log)"
    cat "$log"
  fi
  return "$status"
}

# other_half STACK NOTEBOOK...: the Colab-shaped leg's other notebooks, with a JAX cache of
# their own (two processes writing one cache could read each other's half-written entries).
other_half() {
  local stack="$1"
  shift
  rm -rf "$JAX_COMPILATION_CACHE_DIR-2" "build/pytest-$stack-2"
  JAX_COMPILATION_CACHE_DIR="$JAX_COMPILATION_CACHE_DIR-2" python -m pytest "$@" \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider \
    --basetemp "build/pytest-$stack-2" --durations=10
}

# At eight devices, on the Kaggle-shaped leg: the notebooks that lay out their own batches,
# models and stock runs over the devices (00; 01 on sentence pairs, segment ids laid out
# too) and the decoder's mesh (10 on Gemma 3: its layer names, heads-first kernels, scaled
# embeddings and two stop tokens differ most from Qwen 3, the Colab-shaped leg's run). The
# others run at one device on the Colab-shaped leg and at two in the main job; their
# batches at eight in the unit tests.
eight_devices_notebooks() {
  local stack="$1" n
  shift
  python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack-8" \
    --only 00 --replicas 8 --no-variants || return
  for n in 01_text_classification_fit.pairs 10_decoder_lora_fine_tuning.gemma; do
    python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack-8" \
      --only "$n" --replicas 8 || return
  done
  env -u JAX_COMPILATION_CACHE_DIR python -m pytest "build/nbval-$stack-8" --nbval-lax \
    --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider \
    --basetemp "build/pytest-$stack-8" --durations=10 "$@"
}

# side_by_side STEP NAME [ARGS]: STEP "$stack" [ARGS] for every stack of run_stacks at
# once, each into build/NAME-<stack>.log; the logs are printed when all have ended; fails if one did.
side_by_side() {
  local step="$1" name="$2" failed=0
  shift 2
  local -A pids
  for stack in "${run_stacks[@]}"; do
    ("$step" "$stack" "$@") > "build/$name-$stack.log" 2>&1 &
    pids[$stack]=$!
  done
  for stack in "${run_stacks[@]}"; do
    wait "${pids[$stack]}" || failed=1
  done
  for stack in "${run_stacks[@]}"; do
    echo "=== $name, $stack stack (build/$name-$stack.log)"
    cat "build/$name-$stack.log"
  done
  return "$failed"
}

# An environment, and the offline fixtures with the first one as soon as it is there.
# The fixtures hold the TF engine's reference numbers, so a Keras 3 leg alone builds them
# in the CPU stack.
prepare() {
  if is_keras3 "$1" && [ "${#stacks[@]}" -eq 1 ]; then  # in a shell of its own
    env -u PYENV_VERSION -u PYTHON STACK=cpu bash -c \
      'source tools/env.sh && python -m tpu_helpers fixtures build/fixtures'
  fi
  STACK="$1" && source tools/env.sh
  if [ "$1" = "${stacks[0]}" ] && ! is_keras3 "$1"; then
    python -m tpu_helpers fixtures build/fixtures
  fi
}

# A leg, with its time, exit status and CPU time (of its processes) at the end of its log.
timed_leg() {
  local leg_start=$SECONDS status=0
  (leg "$@") || status=$?
  times > "build/times-$1"  # a builtin's own output: a pipe would run it in a subshell
  echo "=== $1 stack: $((SECONDS - leg_start)) s, exit $status, CPU user and sys: $(tail -1 "build/times-$1")"
  return "$status"
}

# The environments first, all at once (the install cells' pip mostly waits on downloads).
mkdir -p build
# The four environments and the build take about 12 GB: a full disk fails a leg half way
echo "=== disk: $(df -h . | awk 'NR == 2 {print $4 " free of " $2}')"
run_stacks=("${stacks[@]}")
side_by_side prepare env || { echo "an environment or the fixtures could not be made" >&2; exit 1; }

if [ "${#stacks[@]}" -eq 1 ]; then  # one leg: its output as it goes
  timed_leg "${stacks[0]}" "$@"
  exit
fi

start=$SECONDS
failed=0
side_by_side timed_leg test "$@" || failed=1
echo "=== all stacks: $((SECONDS - start)) s side by side"
exit "$failed"
