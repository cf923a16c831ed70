"""Generated from proto/rollstream/v1 by scripts/gen_protos.py; do not edit."""
