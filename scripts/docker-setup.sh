#!/usr/bin/env bash
exec "$(dirname "$0")/../.ci/docker-setup.sh" "$@"
