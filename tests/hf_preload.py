"""What the suite's forkserver imports for the Hugging Face tests' ranks (conftest.py preloads it).

Every rank of the suite is forked from one server that has imported Lightning and the package; a rank
of a Hugging Face test then imported transformers, peft and litgpt itself (from ``.hf_packages``:
hf_env.py), ~2.3 s of CPU per rank, in a dozen jobs. Imported here once, after Lightning (torchmetrics
has already decided without transformers, as in the tests' own processes), they cost nothing per rank.
Where they are not installed (outside ``make test``), nothing is preloaded and the tests skip as before.
"""

import importlib

import hf_env  # noqa: F401  (.hf_packages on the path, after Lightning)

# The families the tests build (hf_models.py), peft's LoRA and litgpt's GPT.
MODULES = {
    "transformers": ("LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM", "MistralForCausalLM",
                     "GemmaForCausalLM", "GPTNeoXForCausalLM"),
    "peft": ("LoraConfig", "get_peft_model"),
    "litgpt.model": ("GPT",),
}  # fmt: skip

for module, names in MODULES.items():
    try:
        loaded = importlib.import_module(module)
        for name in names:
            getattr(loaded, name)  # (transformers' classes load their modules lazily, on first access)
    except ImportError:
        pass
