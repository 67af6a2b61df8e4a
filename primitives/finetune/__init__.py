"""Fine-tuning: LoRA recovery (adapters trained with peft, merged back in); GLUE task models and full fine-tuning."""

from slimkit.primitives.finetune.glue_task_model import GlueFinetuneConfig, finetune_glue, task_model
from slimkit.primitives.finetune.lora import LoraConfig, LoraTraining, lora_recover, merge_lora, train_lora

__all__ = [
    "GlueFinetuneConfig",
    "LoraConfig",
    "LoraTraining",
    "finetune_glue",
    "lora_recover",
    "merge_lora",
    "task_model",
    "train_lora",
]
