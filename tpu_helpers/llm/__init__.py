"""The decoder LLM lesson's code (notebook 10), in a folder of its own: what the notebook
plugs in beside its page (``decoders``: the memory plan, LoRA counts, layout checks, the
merged export and the PEFT adapter) and its offline stand-ins (``fixtures``: tiny Qwen 3,
Llama 3 and Gemma 3 checkpoints in the hub's layout, an instruction set). It builds on the
Keras 3 engine and the data layer; only the teaching code's fixture builder, above it,
imports it.
"""
