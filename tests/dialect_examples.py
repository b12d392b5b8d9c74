"""Every example document of seeds 000, 002, 003 and 004, as data (shared by the dialect tests).

Seed 003 gives its examples as Python (``CollaborationHandoff(...)`` / ``CollaborationResult(...)``);
they are written here as the JSON those dataclasses serialise to.
"""
from __future__ import annotations

import copy
from typing import Any

# ---------------------------------------------------------------- seed 000: hi_moe messages
HI_MOE_ARCHITECT_TO_DISPATCHER: dict[str, Any] = {
    "version": "1.0.0",
    "id": "msg-001",
    "timestamp": "2025-01-15T10:30:00Z",
    "source_tier": "ABSTRACT_ARCHITECT",
    "target_tier": "ROUTING_DISPATCHER",
    "correlation_id": None,
    "payload": {
        "task_type": "decompose_and_solve",
        "objective": "Implement binary search with edge case handling",
        "constraints": ["Must handle empty arrays", "O(log n) time complexity required"],
        "context_refs": ["beads:problem-statement", "beads:test-cases"],
        "priority": 1,
        "timeout_ms": 60000,
        "deadline_hint": None,
        "specialist_hint": None,
        "task_data": {"problem_id": "leetcode-704", "language": "python"},
    },
}

HI_MOE_DISPATCHER_TO_FLEET: dict[str, Any] = {
    "version": "1.0.0",
    "id": "msg-002",
    "timestamp": "2025-01-15T10:30:05Z",
    "source_tier": "ROUTING_DISPATCHER",
    "target_tier": "SPECIALIZED_FLEET",
    "correlation_id": "msg-001",
    "payload": {
        "task_type": "execute_code",
        "objective": "Write binary search function",
        "constraints": ["Return -1 if not found"],
        "context_refs": ["beads:problem-statement"],
        "priority": 1,
        "timeout_ms": 30000,
        "deadline_hint": None,
        "specialist_hint": "python-lora",
        "task_data": {
            "subtask_index": 1,
            "subtask_total": 3,
            "input_signature": "def binary_search(nums: List[int], target: int) -> int",
            "test_cases": ["beads:test-cases"],
        },
    },
}

HI_MOE_CANCELLATION: dict[str, Any] = {
    "version": "1.0.0",
    "id": "msg-cancel-001",
    "timestamp": "2025-01-15T10:31:00Z",
    "source_tier": "ABSTRACT_ARCHITECT",
    "target_tier": "ROUTING_DISPATCHER",
    "correlation_id": None,
    "payload": {
        "target_message_id": "msg-001",
        "reason": "Strategy revision - new approach identified",
        "cascade": True,
    },
}

HI_MOE_FLEET_TO_DISPATCHER: dict[str, Any] = {
    "version": "1.0.0",
    "id": "msg-003",
    "timestamp": "2025-01-15T10:30:45Z",
    "source_tier": "SPECIALIZED_FLEET",
    "target_tier": "ROUTING_DISPATCHER",
    "correlation_id": "msg-002",
    "payload": {
        "status": "success",
        "summary": "Implemented binary search with edge case handling. All test cases pass.",
        "result_refs": ["beads:execution/outputs/msg-002"],
        "confidence": 0.92,
        "execution_time_ms": 3200,
        "resources_used": {"lora": "python-lora", "tokens_in": 450, "tokens_out": 280},
        "surprise_flag": False,
        "surprise_reason": None,
        "error_type": None,
        "error_detail": None,
        "recoverable": None,
        "artifacts": [
            {
                "artifact_type": "code",
                "content_ref": "beads:execution/outputs/msg-002",
                "inline_content": None,
                "metadata": {"language": "python", "lines": 15, "complexity": "O(log n)"},
            },
            {
                "artifact_type": "test_result",
                "content_ref": None,
                "inline_content": "5/5 tests passed",
                "metadata": {"passed": 5, "failed": 0},
            },
        ],
    },
}

HI_MOE_AGGREGATED: dict[str, Any] = {
    "version": "1.0.0",
    "id": "msg-agg-001",
    "timestamp": "2025-01-15T10:32:00Z",
    "source_tier": "ROUTING_DISPATCHER",
    "target_tier": "ABSTRACT_ARCHITECT",
    "correlation_id": "msg-001",
    "payload": {
        "status": "partial",
        "summary": "2/3 subtasks completed. Test generation failed.",
        "result_refs": ["beads:routing/task-graph"],
        "confidence": 0.78,
        "execution_time_ms": 8500,
        "resources_used": {"parallel_tasks": 3, "specialists_used": ["python-lora", "test-lora"]},
        "surprise_flag": False,
        "surprise_reason": None,
        "error_type": "partial_completion",
        "error_detail": "test-lora failed: timeout after 30000ms",
        "recoverable": True,
        "artifacts": [
            {
                "artifact_type": "aggregation_summary",
                "content_ref": None,
                "inline_content": "{\"strategy\": \"all_success\", \"succeeded\": 2, \"failed\": 1}",
                "metadata": {
                    "child_outcomes": [
                        {"id": "msg-002", "status": "success", "specialist": "python-lora"},
                        {"id": "msg-003", "status": "success", "specialist": "python-lora"},
                        {"id": "msg-004", "status": "timeout", "specialist": "test-lora"},
                    ]
                },
            }
        ],
    },
}

# The clarification example is an OutcomePayload fragment, not a whole message.
HI_MOE_CLARIFICATION_PAYLOAD: dict[str, Any] = {
    "status": "needs_clarification",
    "summary": "Ambiguous requirements for edge case handling",
    "error_type": "ambiguous_request",
    "error_detail": "Should empty array return -1 or raise exception?",
    "recoverable": True,
}

HI_MOE = {
    "architect_to_dispatcher": HI_MOE_ARCHITECT_TO_DISPATCHER,
    "dispatcher_to_fleet": HI_MOE_DISPATCHER_TO_FLEET,
    "cancellation": HI_MOE_CANCELLATION,
    "fleet_to_dispatcher": HI_MOE_FLEET_TO_DISPATCHER,
    "aggregated": HI_MOE_AGGREGATED,
}

# ---------------------------------------------------------------- seed 002: AgentHandoff
AGENT_SUCCESS: dict[str, Any] = {
    "handoff_id": "a1b2c3d4-e5f6-7890-abcd-ef1234567890",
    "conversation_id": "conv-2026-01-15-001",
    "from_agent": "code-generator",
    "to_agent": "code-quality-reviewer",
    "status": "success",
    "timestamp": "2026-01-15T10:30:00Z",
    "context": {
        "objective": "Implement data preprocessing pipeline",
        "scope": {
            "in_scope": ["CSV parsing", "Data validation", "Normalization"],
            "out_of_scope": ["Database storage", "API endpoints"],
        },
        "constraints": ["Memory < 8GB", "Process 10K rows/sec"],
    },
    "results": {
        "summary": "Complete preprocessing pipeline with validation and normalization",
        "artifacts": [
            {"name": "preprocessor.py", "path": "src/data/preprocessor.py", "type": "code",
             "description": "Main preprocessing module"},
            {"name": "test_preprocessor.py", "path": "tests/test_preprocessor.py", "type": "code",
             "description": "Unit tests with 98% coverage"},
        ],
        "metrics": {"test_coverage": 0.98, "lines_of_code": 320, "throughput": "12K rows/sec"},
        "verification": {"tests_passed": True, "coverage": 0.98, "execution_verified": True,
                         "verification_method": "pytest with benchmark"},
    },
    "action_required": {
        "task": "Review code for Tier 1/2 quality issues",
        "instructions": [
            "Check for concurrency issues in batch processing",
            "Verify memory usage stays under 8GB",
            "Review error handling completeness",
        ],
        "expected_output": "Quality report with pass/fail decision",
        "priority": "high",
    },
    "metadata": {"execution_time_ms": 45000, "tool_calls": 12,
                 "chain_position": {"step": 2, "total_steps": 4}},
}

AGENT_PARTIAL: dict[str, Any] = {
    "handoff_id": "b2c3d4e5-f6a7-8901-bcde-f23456789012",
    "conversation_id": "conv-2026-01-15-002",
    "from_agent": "deep-research",
    "to_agent": "planner",
    "status": "partial",
    "timestamp": "2026-01-15T11:45:00Z",
    "context": {
        "objective": "Research distributed training frameworks",
        "constraints": ["Must support PyTorch", "Budget < $10K/month"],
    },
    "results": {
        "summary": "Completed framework comparison, blocked on pricing verification",
        "artifacts": [
            {"name": "framework_comparison.md",
             "path": "documents/reference/technical/framework_comparison.md", "type": "document"},
        ],
        "metrics": {"frameworks_analyzed": 5, "sources_consulted": 23},
    },
    "blockers": [
        {
            "blocker_id": "blk-001",
            "type": "missing_input",
            "description": "Unable to verify Ray pricing for enterprise tier",
            "resolution_options": [
                "Contact Ray sales for quote",
                "Use published pricing as estimate",
                "Exclude Ray from consideration",
            ],
            "blocking_tasks": ["final_recommendation", "budget_allocation"],
        }
    ],
    "action_required": {
        "task": "Create implementation plan with available information",
        "instructions": [
            "Use framework comparison as input",
            "Mark Ray pricing as [NEEDS VERIFICATION]",
            "Provide alternatives if Ray is chosen",
        ],
        "expected_output": "Implementation plan with contingencies",
        "priority": "medium",
    },
}

AGENT_BLOCKED: dict[str, Any] = {
    "handoff_id": "c3d4e5f6-a7b8-9012-cdef-345678901234",
    "conversation_id": "conv-2026-01-15-003",
    "from_agent": "slurm-manager",
    "to_agent": "orchestrator",
    "status": "blocked",
    "timestamp": "2026-01-15T14:20:00Z",
    "context": {
        "objective": "Submit training job on GPU cluster",
        "constraints": ["Requires 4x A100 GPUs", "24-hour time limit"],
    },
    "results": {"summary": "Job submission failed - no available resources", "artifacts": [],
                "metrics": {}},
    "blockers": [
        {
            "blocker_id": "blk-gpu-001",
            "type": "resource_unavailable",
            "description": "No 4x A100 nodes available. Current queue: 15 jobs, ETA: 6+ hours",
            "resolution_options": [
                "Wait for resources (ETA: 6 hours)",
                "Reduce to 2x A100 (available now)",
                "Use 4x A40 alternative (available now)",
                "Defer to off-peak hours (after 22:00)",
            ],
            "blocking_tasks": ["training_execution", "model_evaluation"],
        }
    ],
    "action_required": {
        "task": "Decide resource allocation strategy",
        "instructions": [
            "Evaluate resolution options",
            "Consider timeline constraints",
            "Select option and update plan",
        ],
        "expected_output": "Decision on resource allocation with justification",
        "priority": "critical",
    },
    "metadata": {"execution_time_ms": 5000, "retry_count": 3},
}

# "Creating a Handoff" in seed 002's usage guidelines (uuid4 and utcnow filled in).
AGENT_USAGE: dict[str, Any] = {
    "handoff_id": "3f2b8c1e-9d4a-4e6b-8a7c-1d2e3f4a5b6c",
    "conversation_id": "conv-usage-001",
    "from_agent": "code-generator",
    "to_agent": "code-quality-reviewer",
    "status": "success",
    "timestamp": "2026-01-15T09:00:00.123456Z",
    "context": {"objective": "Implement user authentication module",
                "constraints": ["Python 3.8+", "No external auth services"]},
    "results": {
        "summary": "Generated auth module with JWT support",
        "artifacts": [
            {"name": "auth.py", "path": "src/auth/auth.py", "type": "code"},
            {"name": "test_auth.py", "path": "tests/test_auth.py", "type": "code"},
        ],
        "metrics": {"test_coverage": 0.95, "lines_of_code": 245},
        "verification": {"tests_passed": True, "coverage": 0.95},
    },
    "action_required": {"task": "Review generated code for quality issues", "priority": "high"},
}

AGENT = {"success": AGENT_SUCCESS, "partial": AGENT_PARTIAL, "blocked": AGENT_BLOCKED,
         "usage": AGENT_USAGE}

# ---------------------------------------------------------------- seed 003: HAIOS
HAIOS_HANDOFF: dict[str, Any] = {
    "handoff_id": "6f1c2a9e-3b4d-4c5e-9f7a-8b9c0d1e2f3a",
    "from_agent": "interpreter-v1",
    "to_agent": "ingester-v1",
    "created_at": "2025-12-02T21:55:34Z",
    "payload": {
        "directive": {"action": "ingest", "type": "episteme"},
        "context": {"confidence": 0.85, "grounded": True},
        "original_input": "Store this ADR as knowledge",
    },
    "expected_output_schema": None,
    "timeout_ms": 30000,
    "status": "pending",
}

HAIOS_RESULT: dict[str, Any] = {
    "handoff_id": "6f1c2a9e-3b4d-4c5e-9f7a-8b9c0d1e2f3a",
    "executed_by": "ingester-v1",
    "executed_at": "2025-12-02T21:55:40Z",
    "status": "success",
    "result": {"entities_created": 1, "concepts_created": 3, "source_path": "handoff"},
    "error": None,
}

HAIOS = {"handoff": HAIOS_HANDOFF, "result": HAIOS_RESULT}

# ---------------------------------------------------------------- seed 004: swarm
SWARM_HANDOFF: dict[str, Any] = {
    "contract": {
        "task_id": "bd-123.2",
        "files_owned": ["src/auth/service.ts", "src/auth/service.test.ts"],
        "files_readonly": ["src/types/user.ts", "src/lib/jwt.ts"],
        "dependencies_completed": ["bd-123.1"],
        "success_criteria": [
            "AuthService.login() returns JWT token",
            "Tests pass: bun test src/auth/service.test.ts",
            "Type check passes: tsc --noEmit",
        ],
    },
    "context": {
        "epic_summary": "Add OAuth authentication to user service",
        "your_role": "Implement AuthService with JWT token generation",
        "what_others_did": "bd-123.1 created User schema with email/password fields",
        "what_comes_next": "bd-123.3 will integrate this service into API routes",
    },
    "escalation": {
        "blocked_contact": "coordinator",
        "scope_change_protocol": "swarmmail_send(subject='Scope Change', ack_required=true)",
    },
}

SWARM = {"handoff": SWARM_HANDOFF}

# name → (document, dialect, schema it validates against)
ALL: dict[str, tuple[dict[str, Any], str, str]] = {
    **{f"hi_moe/{k}": (v, "hi_moe", "hi_moe.message.schema.json") for k, v in HI_MOE.items()},
    **{f"agent_handoff/{k}": (v, "agent_handoff", "agent_handoff.schema.json")
       for k, v in AGENT.items()},
    "haios/handoff": (HAIOS_HANDOFF, "haios", "haios.collaboration_handoff.schema.json"),
    "haios/result": (HAIOS_RESULT, "haios", "haios.collaboration_result.schema.json"),
    "swarm/handoff": (SWARM_HANDOFF, "swarm", "swarm.worker_handoff.schema.json"),
}


def fresh(doc: dict[str, Any]) -> dict[str, Any]:
    """A deep copy to mutate."""
    return copy.deepcopy(doc)
