"""The mixture-of-experts levers: the experts' grouped GEMM (`--moe-grouped-gemm`) and the token
permutation's fusion (`--moe-permute-fusion`); shapes and routing (shapes.py, routing.py), the
expert paths (experts.py), the permutation paths (permutation.py), the levers and their tiers."""
