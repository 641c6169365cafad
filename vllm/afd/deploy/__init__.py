# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Deployment tools apart from serving: the `vllm-afd` command, the launcher
(launch/) and the planner (planner/). Nothing here runs inside a server."""
