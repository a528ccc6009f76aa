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
#           5.15, no TensorFlow, no PyTorch): its tests at eight devices, the main
#           track's notebooks at one (Colab's free v5e-1; 01 as the
#           teaching page's no-TPU recipe runs it), and the decoders' tests.
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
  if is_keras3 "$stack"; then  # the TF legs first: the CPU leg is the longest
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
      "${only[@]}" --replicas "$replicas" "${precision[@]}"
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
    --only 00 --replicas 8
  python tools/run_notebooks.py --prepare-only --engine tf --out build/nbval-tpu \
    --only 01_text_classification_fit.pairs --replicas 2
  python -m pytest tests/test_runtime.py tests/test_install_plans.py tests/test_cli.py \
    tests/test_doctor.py tests/test_strategy.py tests/test_pod.py build/nbval-tpu \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=900 -p no:cacheprovider \
    --basetemp build/pytest-tpu --durations=15 "$@"
}

# The Keras 3 legs (keras3: Kaggle's image; colab: Colab's): the engine's tests (against
# the TF engine's numbers in the fixtures, at eight devices, kill and resume included),
# the engine choice and install plans, the image preprocessing read without PyTorch, and
# the main track's notebooks cell by cell in bfloat16 (their default), each leg at the
# device count of its runtime: the Colab-shaped leg at one (Colab's free v5e-1), without
# the sentence-pair variants (below); the Kaggle-shaped leg
# at eight (a v5e-8) for the notebooks that lay out their own batches and stock runs (below),
# 01 on its sentence-pair variant, and the two-process rehearsals of a pod slice (on loopback), which run
# there only: the CI rehearsal of 2026-12-05 took 29.5 minutes in all with every variant at
# eight and the rehearsals on both legs. The notebooks at eight run in a pytest of their own, without
# the leg's compilation cache.
# Kernels at eight devices died (2026-12-04, 12-05) or hung (12-05) in CI: XLA's CPU pool
# of one thread per simulated device can leave devices waiting for good at an all-reduce;
# env.sh and keras3.devices give it two per device (keras3.simulation_env). The keras3 leg also
# runs the main track's exercise editions to their first stubs, and the exercise checks
# against wrong answers. They run beside the TensorFlow legs at the lowest priority: the
# TensorFlow legs leave a core idle for minutes at a time (single-threaded tracing and
# compiling), which these take. (Their environments were made in the legs too, at that
# priority, until two of them took 14 minutes there on 2026-12-04.) JAX's persistent
# compilation cache lives for the leg (one notebook's compilations serve another's of the
# same shapes). A cell may take 300 s (the longest took 37 s in
# CI): a kernel that dies mid-cell is reported after that, not after 15 minutes.
keras3_leg() {
  local stack="$1" more=() notebooks=("build/nbval-$stack") status=0
  shift
  export JAX_COMPILATION_CACHE_DIR="$PWD/build/jax-cache-$stack" PYTHONFAULTHANDLER=1
  cheap_compiles  # tools/env.sh says why
  rm -rf "$JAX_COMPILATION_CACHE_DIR" "build/nbval-$stack-8" "build/pytest-$stack-8"
  if [ "$stack" = keras3 ]; then  # the exercise checks' wrong answers, on one leg
    more=(tests/test_exercises.py tests/test_workshop_jax.py)
    # Of the two pod-slice rehearsals, the one on TFRecord shards (each host reading its
    # own) runs beside the other legs; the in-memory one (93 s of this leg in the CI
    # rehearsal of 2026-12-06, the whole run then 34 minutes) when this leg runs alone.
    if [ "${#stacks[@]}" -gt 1 ]; then
      more+=(-k "not two_processes_on_loopback")
    fi
    notebooks=()  # Kaggle's v5e-8: five notebooks at eight devices, below
  else  # Colab's v5e-1: every notebook at one device
    python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack" \
      --replicas 1 --no-variants
    # notebook 01 at one device on this stack is the no-TPU recipe's run (tests/test_offline.py
    # executes every cell, with the same parameter file): not twice on the longest leg
    rm "build/nbval-$stack/01_text_classification_fit.ipynb"
    # The sentence-pair variants run with tools/run.sh --variants (their token types through
    # a loop, records, rules and packed rows that take them as any other feature), and 01's
    # at eight devices on the other leg. In the CI rehearsals of 2026-12-06 on this leg: 03's 150 s,
    # 02's 150 s, 05's 90 s, 01's 172 s in two cells, 07's about 40 s. Of the image
    # families, 04 runs on ViT here; on Swin (at eight devices on the other leg until the CI
    # rehearsal of 2026-12-07, 36 minutes side by side, that leg the last to end with
    # 119 s of two of its cells), on the distilled DeiT and 03 on ELECTRA with
    # tools/run.sh --variants since the CI rehearsal of 2026-12-06 that took 33.6 minutes
    # with them (both legs of Keras 3 about 1,730 s), their heads, converters and bfloat16
    # in test_keras3 still.
    # On the other leg only, what no package or JAX version here changes: the pod-slice
    # rehearsals; the engines' equality and the masked-LM heads of every family (the same
    # KerasHub converters on both legs); the core's refusals of a run that cannot go on
    # (another learning rate, a nan loss, data that ends early, class ids or token ids
    # without a row in the model); and the resumes of a killed run, a rebuilt model, packed and masked-LM runs
    # (the package's own saves). The CI of 2026-12-06 took 2491 s with some of these on both
    # legs. This leg keeps what its JAX can change: the compile counts, the fused steps,
    # the no-TPU recipe and the notebooks (02 stops and resumes).
    local skip="two_hosts or two_processes"
    skip+=" or same_logits_loss_and_step or masked_lm_head_read_from"
    skip+=" or another_learning_rate or no_longer_a_number or data_ends_before"
    skip+=" or class_ids_of_in_memory or ids_the_model_has_no_row_for"
    skip+=" or killed_run_resumes or made_again_resume or stopped_mid_epoch_resumes"
    # and the package's own saves read back: in the hub's layout, by either engine (111 s, 82 s
    # and 157 s of this leg in the CI rehearsals of 2026-12-06), and the fall-back to the save
    # before a lost or damaged one (50 s and 30 s)
    skip+=" or saved_in_the_hubs_layout_loads_back or tf_engine_loads_what_the_keras3_engine_saved"
    skip+=" or newest_save_falls_back"
    # and the hub's layouts read and written: shards with their index, a save on a bucket,
    # the saves refused (the package's own readers and writers, the same on both legs)
    skip+=" or sharded_layout_gives or saved_on_a_bucket or layout_cannot_hold"
    # and the packed rows of every family but DistilBERT (the same KerasHub layers and masks on
    # both legs; 115 s of tests/test_keras3_packing.py on this stack alone, 2026-12-07)
    skip+=" or (each_packed_example_gets_the_logits and not distilbert)"
    skip+=" or (packed_step_trains_the_classifier and not distilbert)"
    # and the image heads read and saved by KerasHub's converters (a distilled DeiT's two, Swin's)
    skip+=" or distilled_deit_averages or trained_swin_is_saved"
    # and bfloat16 on the families after DistilBERT (forward passes of the same layers)
    skip+=" or (bfloat16_computes_close and not distilbert)"
    # and what only Keras and KerasHub decide (the same releases on both legs): their private
    # parts, a new head's report, another run's folder (51 s, 32 s, 38 s of this leg in the CI
    # rehearsal of 2026-12-06). The decoders' tests run here only, on Colab's JAX: notebook
    # 10's runtime (the other leg ended last by 4 minutes with them in a CI rehearsal).
    skip+=" or private_keras_and_kerashub_parts or base_checkpoint_gets_a_new_head"
    skip+=" or another_checkpoints_run_is_not_resumed"
    more=(tests/test_offline.py tests/test_decoders.py -k "not ($skip)")
  fi
  # Each pytest's status is kept: the leg runs under `(leg) || status=$?` (timed_leg), where
  # bash ignores set -e, so a failing first run would otherwise pass unseen.
  python -m pytest tests/test_keras3.py tests/test_keras3_packing.py tests/test_runtime.py "${more[@]}" "${notebooks[@]}" \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 \
    -p no:cacheprovider --basetemp "build/pytest-$stack" --durations=15 "$@" || status=$?
  if [ "$stack" = keras3 ]; then
    # At eight devices (a v5e-8): the notebooks whose batches, models and stock runs are laid
    # out over the devices by the notebook itself (00, 01) and the decoder's mesh (10).
    # 02, 05, 06 and 09 run at one device on the Colab-shaped leg and at two in the main
    # job: with the stock runs of 01, 03 and 04 added, the CI rehearsal of 2026-12-06 with
    # every notebook at eight took about 45 minutes, this leg among the last to end. 07 on
    # DeBERTa-v3 ran here until its padded stock epoch came (83 s of one cell at eight in
    # the CI rehearsal of 2026-12-06, this leg the last to end): it runs with
    # tools/run.sh --variants, 07 at one device on the other leg, and the packed rows of
    # every family at eight in tests/test_keras3_packing.py.
    python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack-8" \
      --only 00 --replicas 8 --no-variants || status=$?
    # 01 on its sentence-pair variant (segment ids laid out too), 10 on Gemma 3 over a 2 x 4
    # mesh (the family whose page code differs most: its layer names, heads-first kernels,
    # scaled embeddings, blocks that take a padding mask, two stop tokens): their first runs
    # (single sentences, Qwen 3) are the Colab-shaped leg's, at one device. 03 and 04 run at
    # one device there (their images' and shards' batches at eight in tests/test_keras3.py).
    # 10 on Llama 3 runs with tools/run.sh --variants; its layout, logits and export are held
    # by tests/test_decoders.py on the Colab-shaped leg.
    local n
    for n in 01_text_classification_fit.pairs 10_decoder_lora_fine_tuning.gemma; do
      python tools/run_notebooks.py --prepare-only --engine keras3 --out "build/nbval-$stack-8" \
        --only "$n" --replicas 8 || status=$?
    done
    env -u JAX_COMPILATION_CACHE_DIR python -m pytest "build/nbval-$stack-8" --nbval-lax \
      --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider \
      --basetemp "build/pytest-$stack-8" --durations=10 "$@" || status=$?
  fi
  return "$status"
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

# The environments first, all at once (pip mostly unpacks wheels, each into its own
# folder: two took 160 s and 231 s one after the other on 2 cores, 128 s at once).
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
