"""The machine under the run: device detection, the environment check, the Ascend version matrix, npu-smi, collectives."""
