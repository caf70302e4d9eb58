"""The machine under the run, below every recipe: device detection (detect.py), the Ascend version matrix
(compat.py, compat.yaml), npu-smi's tables (npusmi.py), collectives (collective.py) and the device probes
(probes/: cpu, nvidia, ascend), which know device ids and roles, not recipes."""
