"""Recovery fine-tuning after compression: LoRA adapters trained with peft and merged back in."""

from slimkit.primitives.finetune.lora import LoraConfig, LoraTraining, lora_recover, merge_lora, train_lora

__all__ = ["LoraConfig", "LoraTraining", "lora_recover", "merge_lora", "train_lora"]
