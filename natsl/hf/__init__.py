"""Hugging Face interchange: `natsl convert --to hf` / `--from-hf` (natsl.hf.export) and the
remote-code model classes copied into exported folders (natsl.hf.modeling_natsl)."""
