#!/usr/bin/env bash
# The device run of issue 18 (2 GPUs): see bench/tp_device.sh.
exec bash "$(dirname "$0")/../bench/tp_device.sh" "$@"
