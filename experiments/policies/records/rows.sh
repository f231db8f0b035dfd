# The policy rows of experiments/policies at equal stored bytes (bits per element over the prompt, everything
# counted: `cache/bits_total`), sourced by run_policies.sh. Simulated mode, exact prefill, keys per channel, values
# per token; a row's name is <budget>_<policy>.
declare -A ROWS=(
  [3.0_kivi]="bits=2 group_size=32"
  [3.0_saliency]="bits=2 group_size=64 policy=saliency policy.high=0.2 policy.high_bits=4 policy.high_group=32"
  [3.0_mikv]="bits=4 group_size=32 policy=mikv policy.keep=0.2 policy.low_bits=2 policy.low_group=64"
  [3.0_evict]="bits=4 group_size=32 policy=evict policy.keep=0.6"
  [2.5_kivi]="bits=2 group_size=64"
  [2.5_saliency]="bits=1 group_size=32 policy=saliency policy.high=0.167 policy.high_bits=4 policy.high_group=32"
  [2.5_mikv]="bits=4 group_size=32 policy=mikv policy.keep=0.167 policy.low_bits=1 policy.low_group=32"
  [2.5_evict]="bits=4 group_size=32 policy=evict policy.keep=0.5"
  [16_fp16]="bits=16"
)
ORDER="16_fp16 3.0_kivi 3.0_saliency 3.0_mikv 3.0_evict 2.5_kivi 2.5_saliency 2.5_mikv 2.5_evict"
COMMON="experiment=policies prefill=exact logger=none"
