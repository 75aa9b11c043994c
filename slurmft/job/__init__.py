"""Everything that runs inside the allocation. Modules here may import torch; the CLI must not import them."""
