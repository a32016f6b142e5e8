"""Model families over shared layers; ModelConfig.from_hf is the only reader of config.json."""
