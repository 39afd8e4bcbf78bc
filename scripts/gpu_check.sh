#!/usr/bin/env bash
# Kept for old references: the device checks now live in scripts/device_check.sh.
exec bash "$(dirname "$0")/device_check.sh" "$@"
