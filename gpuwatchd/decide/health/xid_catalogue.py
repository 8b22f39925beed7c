"""NVIDIA's Xid catalogue as data (docs/findings.md#xid-table), what gpuwatchd does with each
resolution bucket (:func:`xid_action`), and the Markdown table of docs/findings.md.

In detail: docs/internals.md, section `gpuwatchd.decide.health.xid_catalogue`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

CATALOGUE_SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


class Bucket(str, enum.Enum):
    """The catalogue's immediate resolution buckets (its own spelling)."""

    RESET_GPU = "RESET_GPU"  # terminate the GPU's processes, reset it (nvidia-smi -r)
    RESTART_APP = "RESTART_APP"  # the application must restart; the GPU is fine
    IGNORE = "IGNORE"  # informational
    CONTACT_SUPPORT = "CONTACT_SUPPORT"  # no operator remedy (most are unused Xids)
    RESTART_BM = "RESTART_BM"  # power-cycle the machine: the GPU left the bus
    RESTART_VM = "RESTART_VM"  # restart the (confidential-computing) virtual machine
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"  # solo: restart Fabric Manager; else follow the other Xid
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"  # solo: reset the GPU; with 63 or 64: drain and reset
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"  # reset the GPU or reboot the node
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"  # depends on the error's detail (kernel log)
    XID_154 = "XID_154"  # the recovery action changed: read it
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # check power cables and seating
    UPDATE_SWFW = "UPDATE_SWFW"  # update software or firmware
    CHECK_UVM = "CHECK_UVM"  # check the UVM driver / coherent interconnect
    NONE = ""  # the catalogue gives no bucket

    def __str__(self) -> str:
        return self.value or "(none given)"


@dataclass(frozen=True)
class XidEntry:
    """One row of the catalogue. ``investigatory`` is the catalogue's text ("" when blank)."""

    xid: int
    mnemonic: str
    name: str
    immediate: Bucket
    investigatory: str
    memory: bool = False  # also covered by NVIDIA's memory error management guide
    read_directly: bool = False  # read on NVIDIA's page itself (else: the spreadsheet's copy)


# NVIDIA's catalogue, one row per Xid: ``xid MNEMONIC | name | immediate | investigatory``
# (an empty bucket is left off; a trailing backslash continues a row on the next line). Rows
# 1-13 were read on NVIDIA's page itself, the others on its spreadsheet's public copy.
_TABLE = """
1 ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD | Unused | CONTACT_SUPPORT
2 ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD | Unused | CONTACT_SUPPORT
3 ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD | Unused | CONTACT_SUPPORT
4 ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY | Unused | CONTACT_SUPPORT
5 ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW | Unused | CONTACT_SUPPORT
6 ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR | Unused | CONTACT_SUPPORT
7 ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR | Unused | CONTACT_SUPPORT
8 ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT | GPU stopped processing | RESTART_APP | CONTACT_SUPPORT
9 ROBUST_CHANNEL_GR_ERROR_INSTANCE | Unused | CONTACT_SUPPORT
10 ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP | Unused | CONTACT_SUPPORT
11 ROBUST_CHANNEL_GR_ERROR_MISSING_HW | Invalid or corrupted push buffer stream | RESTART_APP \
| CHECK_APP/CUDA
12 ROBUST_CHANNEL_GR_ERROR_SW_METHOD | Unused | CONTACT_SUPPORT
13 ROBUST_CHANNEL_GR_EXCEPTION | Graphics engine exception | RESTART_APP | WORKFLOW_XID_13
14 ROBUST_CHANNEL_FAKE_ERROR | Unused | IGNORE | CONTACT_SUPPORT
15 ROBUST_CHANNEL_SCANLINE_TIMEOUT | Unused | CONTACT_SUPPORT
16 ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT | Unused | CONTACT_SUPPORT | CONTACT_SUPPORT
17 ROBUST_CHANNEL_PARAMETER_ERROR | Unused | CONTACT_SUPPORT
18 ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR | Unused | CONTACT_SUPPORT
19 ROBUST_CHANNEL_DISP_MISSED_NOTIFIER | Unused | CONTACT_SUPPORT
20 ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD | Unused | CONTACT_SUPPORT
21 ROBUST_CHANNEL_ME_ERROR_SW_METHOD | Unused | CONTACT_SUPPORT
22 ROBUST_CHANNEL_VP_ERROR_SW_METHOD | Unused | CONTACT_SUPPORT
23 ROBUST_CHANNEL_RC_LOGGING_ENABLED | Unused | CONTACT_SUPPORT
24 ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT | Unused | CONTACT_SUPPORT
25 ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY | Invalid or illegal push buffer stream | RESTART_APP \
| CHECK_APP/CUDA
26 ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT | Unused | CONTACT_SUPPORT
27 ROBUST_CHANNEL_VP_ERROR | Unused | CONTACT_SUPPORT
28 ROBUST_CHANNEL_VP2_ERROR | Unused | CONTACT_SUPPORT
29 ROBUST_CHANNEL_BSP_ERROR | Unused | CONTACT_SUPPORT
30 ROBUST_CHANNEL_BAD_ADDR_ACCESS | Unused | CONTACT_SUPPORT
31 ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT | GPU memory page fault | RESTART_APP | WORKFLOW_XID_31
32 ROBUST_CHANNEL_PBDMA_ERROR | Invalid or corrupted push buffer stream | RESTART_APP \
| CHECK_APP/CUDA
33 ROBUST_CHANNEL_SEC_ERROR | Unused | CONTACT_SUPPORT
34 ROBUST_CHANNEL_MSVLD_ERROR | Unused | CONTACT_SUPPORT
35 ROBUST_CHANNEL_MSPDEC_ERROR | Unused | CONTACT_SUPPORT
36 ROBUST_CHANNEL_MSPPP_ERROR | Unused | CONTACT_SUPPORT
37 ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD | Driver firmware error | IGNORE | CHECK_APP/CUDA
38 ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT | Driver firmware error | IGNORE | CONTACT_SUPPORT
39 ROBUST_CHANNEL_CE0_ERROR | Copy engine exception | RESTART_APP | CONTACT_SUPPORT
40 ROBUST_CHANNEL_CE1_ERROR | Copy engine exception | RESTART_APP | CONTACT_SUPPORT
41 ROBUST_CHANNEL_CE2_ERROR | Copy engine exception | RESTART_APP | CONTACT_SUPPORT
42 ROBUST_CHANNEL_VIC_ERROR | Unused | CONTACT_SUPPORT
43 ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR | GPU stopped processing | IGNORE | CONTACT_SUPPORT
44 ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW | Graphics engine fault during context switch | IGNORE \
| CONTACT_SUPPORT
45 ROBUST_CHANNEL_PREEMPTIVE_REMOVAL | Preemptive cleanup after earlier errors \
| WORKFLOW_XID_45 | Solo: RESTART_FM; not solo: IGNORE (follow the other Xid)
46 ROBUST_CHANNEL_GPU_TIMEOUT_ERROR | GPU stopped processing | RESET_GPU | CONTACT_SUPPORT
47 ROBUST_CHANNEL_NVENC0_ERROR | Unused | CONTACT_SUPPORT
48 ROBUST_CHANNEL_GPU_ECC_DBE | Double-bit ECC error | WORKFLOW_XID_48 | WORKFLOW_XID_48
49 SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY | Unused | CONTACT_SUPPORT
50 SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR | Unused | CONTACT_SUPPORT
51 SILENT_RUNNING_STRESS_TEST_FAILURE | Unused | CONTACT_SUPPORT
52 SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE | Unused | CONTACT_SUPPORT
53 SILENT_RUNNING_TEMP_REDUCED_CLOCKING | Unused | CONTACT_SUPPORT
54 SILENT_RUNNING_PWR_REDUCED_CLOCKING | Auxiliary power not connected | CHECK_MECHANICALS \
| CONTACT_SUPPORT
55 SILENT_RUNNING_TEMPERATURE_READ_ERROR | Unused | CONTACT_SUPPORT
56 DISPLAY_CHANNEL_EXCEPTION | Unused | CONTACT_SUPPORT
57 FB_LINK_TRAINING_FAILURE_ERROR | Unused | CONTACT_SUPPORT
58 FB_MEMORY_ERROR | Unused | CONTACT_SUPPORT
59 PMU_ERROR | Unused | CONTACT_SUPPORT
60 ROBUST_CHANNEL_SEC2_ERROR | Video processor exception | RESTART_APP | INVESTIGATE_SW
61 PMU_BREAKPOINT | Unused | CONTACT_SUPPORT
62 PMU_HALT_ERROR | Internal micro-controller halt | RESET_GPU | CONTACT_SUPPORT
63 INFOROM_DRAM_RETIREMENT_EVENT | GPU memory remapping event | IGNORE | IGNORE
64 INFOROM_DRAM_RETIREMENT_FAILURE | GPU memory remapping failure | RESET_GPU | CONTACT_SUPPORT
65 ROBUST_CHANNEL_NVENC1_ERROR | Unused | CONTACT_SUPPORT
66 ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION | Illegal access by driver | IGNORE | INVESTIGATE_SW
67 ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION | Illegal access by driver | IGNORE | CONTACT_SUPPORT
68 ROBUST_CHANNEL_NVDEC0_ERROR | NVDEC0 exception | RESTART_APP | CONTACT_SUPPORT
69 ROBUST_CHANNEL_GR_CLASS_ERROR | Graphics engine class error | RESTART_APP | CHECK_APP/CUDA
70 ROBUST_CHANNEL_CE3_ERROR | Copy engine 3 error | RESTART_APP | CONTACT_SUPPORT
71 ROBUST_CHANNEL_CE4_ERROR | Copy engine 4 error | RESTART_APP | CONTACT_SUPPORT
72 ROBUST_CHANNEL_CE5_ERROR | Copy engine 5 error | RESTART_APP | CONTACT_SUPPORT
73 ROBUST_CHANNEL_NVENC2_ERROR | Unused | CONTACT_SUPPORT
74 NVLINK_ERROR | NVLink error | WORKFLOW_NVLINK_ERR | CONTACT_SUPPORT
75 ROBUST_CHANNEL_CE6_ERROR | Copy engine 6 error | RESTART_APP | CONTACT_SUPPORT
76 ROBUST_CHANNEL_CE7_ERROR | Copy engine 7 error | RESTART_APP | CONTACT_SUPPORT
77 ROBUST_CHANNEL_CE8_ERROR | Copy engine 8 error | RESTART_APP | CONTACT_SUPPORT
78 VGPU_START_ERROR | vGPU start error | UPDATE_SWFW | UPDATE_SWFW
79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS | GPU has fallen off the bus | RESTART_BM \
| CONTACT_SUPPORT
80 PBDMA_PUSHBUFFER_CRC_MISMATCH | Corrupted data sent to the GPU | RESTART_APP | CHECK_APP/CUDA
81 ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR | Unused | CONTACT_SUPPORT
82 ROBUST_CHANNEL_NVJPG0_ERROR | NVJPG0 error | RESTART_APP | CONTACT_SUPPORT
83 ROBUST_CHANNEL_NVDEC1_ERROR | NVDEC1 error | RESTART_APP | CONTACT_SUPPORT
84 ROBUST_CHANNEL_NVDEC2_ERROR | NVDEC2 error | RESTART_APP | CONTACT_SUPPORT
85 ROBUST_CHANNEL_CE9_ERROR | Copy engine 9 error | RESTART_APP | CONTACT_SUPPORT
86 ROBUST_CHANNEL_OFA0_ERROR | Optical flow accelerator exception | RESTART_APP | CONTACT_SUPPORT
87 NVTELEMETRY_DRIVER_REPORT | Unused | CONTACT_SUPPORT
88 ROBUST_CHANNEL_NVDEC3_ERROR | NVDEC3 error | RESTART_APP | CONTACT_SUPPORT
89 ROBUST_CHANNEL_NVDEC4_ERROR | NVDEC4 error | RESTART_APP | CONTACT_SUPPORT
90 LTC_ERROR | Unused | CONTACT_SUPPORT
91 RESERVED_XID | Unused | CONTACT_SUPPORT
92 EXCESSIVE_SBE_INTERRUPTS | High single-bit ECC error rate | IGNORE | CONTACT_SUPPORT
93 INFOROM_ERASE_LIMIT_EXCEEDED | InfoROM wear limit exceeded (non-fatal) | IGNORE | CONTACT_SUPPORT
94 ROBUST_CHANNEL_CONTAINED_ERROR | Contained memory error | RESTART_APP | IGNORE (sympathetic)
95 ROBUST_CHANNEL_UNCONTAINED_ERROR | Uncontained memory error | RESET_GPU | IGNORE (sympathetic)
96 ROBUST_CHANNEL_NVDEC5_ERROR | NVDEC5 error | RESTART_APP | CONTACT_SUPPORT
97 ROBUST_CHANNEL_NVDEC6_ERROR | NVDEC6 error | RESTART_APP | CONTACT_SUPPORT
98 ROBUST_CHANNEL_NVDEC7_ERROR | NVDEC7 error | RESTART_APP | CONTACT_SUPPORT
99 ROBUST_CHANNEL_NVJPG1_ERROR | NVJPG1 error | RESTART_APP | CONTACT_SUPPORT
100 ROBUST_CHANNEL_NVJPG2_ERROR | NVJPG2 error | RESTART_APP | CONTACT_SUPPORT
101 ROBUST_CHANNEL_NVJPG3_ERROR | NVJPG3 error | RESTART_APP | CONTACT_SUPPORT
102 ROBUST_CHANNEL_NVJPG4_ERROR | NVJPG4 error | RESTART_APP | CONTACT_SUPPORT
103 ROBUST_CHANNEL_NVJPG5_ERROR | NVJPG5 error | RESTART_APP | CONTACT_SUPPORT
104 ROBUST_CHANNEL_NVJPG6_ERROR | NVJPG6 error | RESTART_APP | CONTACT_SUPPORT
105 ROBUST_CHANNEL_NVJPG7_ERROR | NVJPG7 error | RESTART_APP | CONTACT_SUPPORT
106 SMBPBI_TEST_MESSAGE | SMBPBI test message | IGNORE | IGNORE
107 SMBPBI_TEST_MESSAGE_SILENT | SMBPBI test message (silent) | IGNORE | IGNORE
108 NVLINK_REMOTE_TRANSLATION_ERROR | Unused | IGNORE | XID_137_FLOW
109 ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR | Context switch timeout | RESET_GPU | CONTACT_SUPPORT
110 SEC_FAULT_ERROR | Security fault | RESET_GPU | INVESTIGATE_SW
111 BUNDLE_ERROR_EVENT | Unused | CONTACT_SUPPORT
112 DISP_SUPERVISOR_ERROR | Unused | CONTACT_SUPPORT
113 DP_LT_FAILURE | Unused | CONTACT_SUPPORT
114 HEAD_RG_UNDERFLOW | Unused | CONTACT_SUPPORT
115 CORE_CHANNEL_REGS | Unused | CONTACT_SUPPORT
116 WINDOW_CHANNEL_REGS | Unused | CONTACT_SUPPORT
117 CURSOR_CHANNEL_REGS | Unused | CONTACT_SUPPORT
118 HEAD_REGS | Unused | CONTACT_SUPPORT
119 GSP_RPC_TIMEOUT | GSP RPC timeout | RESET_GPU | INVESTIGATE_SW
120 GSP_ERROR | GSP error | RESET_GPU | INVESTIGATE_SW
121 C2C_ERROR | C2C (chip-to-chip link) error | IGNORE | CONTACT_SUPPORT
122 SPI_PMU_RPC_READ_FAIL | Unused | CONTACT_SUPPORT
123 SPI_PMU_RPC_WRITE_FAIL | Unused | CONTACT_SUPPORT
124 SPI_PMU_RPC_ERASE_FAIL | Unused | CONTACT_SUPPORT
125 INFOROM_FS_ERROR | Unused | CONTACT_SUPPORT
126 ROBUST_CHANNEL_CE10_ERROR | Copy engine 10 error | RESTART_APP | CONTACT_SUPPORT
127 ROBUST_CHANNEL_CE11_ERROR | Copy engine 11 error | RESTART_APP | CONTACT_SUPPORT
128 ROBUST_CHANNEL_CE12_ERROR | Copy engine 12 error | RESTART_APP | CONTACT_SUPPORT
129 ROBUST_CHANNEL_CE13_ERROR | Copy engine 13 error | RESTART_APP | CONTACT_SUPPORT
130 ROBUST_CHANNEL_CE14_ERROR | Copy engine 14 error | RESTART_APP | CONTACT_SUPPORT
131 ROBUST_CHANNEL_CE15_ERROR | Copy engine 15 error | RESTART_APP | CONTACT_SUPPORT
132 ROBUST_CHANNEL_CE16_ERROR | Copy engine 16 error | RESTART_APP | CONTACT_SUPPORT
133 ROBUST_CHANNEL_CE17_ERROR | Copy engine 17 error | RESTART_APP | CONTACT_SUPPORT
134 ROBUST_CHANNEL_CE18_ERROR | Copy engine 18 error | RESTART_APP | CONTACT_SUPPORT
135 ROBUST_CHANNEL_CE19_ERROR | Copy engine 19 error | RESTART_APP | CONTACT_SUPPORT
136 ALI_TRAINING_FAIL | NVLink training failed | RESET_GPU | INVESTIGATE_LINK_SI
137 NVLINK_PRIV_ERR | NVLink privilege error | IGNORE | XID_137_FLOW
138 ROBUST_CHANNEL_DLA_ERROR | Unused | CONTACT_SUPPORT
139 ROBUST_CHANNEL_OFA1_ERROR | Optical flow accelerator 1 error | RESTART_APP | CONTACT_SUPPORT
140 UNRECOVERABLE_ECC_ERROR_ESCAPE | Unrecovered ECC error | RESET_GPU | CONTACT_SUPPORT
141 ROBUST_CHANNEL_FAST_PATH_ERROR | CUDA fast path error | IGNORE | CONTACT_SUPPORT
142 ROBUST_CHANNEL_NVENC3_ERROR | NVENC3 error | CONTACT_SUPPORT
143 GPU_INIT_ERROR | GPU initialization error | RESET_GPU | CONTACT_SUPPORT
144 NVLINK_SAW_ERROR | NVLink5 SAW error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
145 NVLINK_RLW_ERROR | NVLink5 RLW error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
146 NVLINK_TLW_ERROR | NVLink5 TLW error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
147 NVLINK_TREX_ERROR | NVLink5 TREX error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
148 NVLINK_NVLPW_CTRL_ERROR | NVLink5 NVLPW_CTRL error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
149 NVLINK_NETIR_ERROR | NVLink5 NETIR error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
150 NVLINK_MSE_ERROR | NVLink5 MSE error | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
151 ROBUST_CHANNEL_KEY_ROTATION_ERROR | Key rotation error (confidential computing) \
| RESTART_VM | CONTACT_SUPPORT
152 ROBUST_CHANNEL_DLA_SMMU_ERROR | DLA SMMU error | IGNORE | CONTACT_SUPPORT
153 ROBUST_CHANNEL_DLA_TIMEOUT | DLA timeout | IGNORE | CONTACT_SUPPORT
154 GPU_RECOVERY_ACTION_CHANGED | GPU recovery action changed | XID_154 \
| N/A: informational, about another Xid
155 NVLINK_SW_DEFINED_ERROR | NVLink software-defined error | RESET_GPU | INVESTIGATE_SW_USER
156 RESOURCE_RETIREMENT_EVENT | Resource retirement event | RESET_GPU | IGNORE
157 RESOURCE_RETIREMENT_FAILURE | Resource retirement failure | IGNORE | CONTACT_SUPPORT
158 GPU_FATAL_TIMEOUT | GPU fatal timeout | RESET_GPU | CONTACT_SUPPORT
159 ROBUST_CHANNEL_CHI_NON_DATA_ERROR | CHI non-data error | CHECK_UVM | SYMPATHETIC_REPORT_SOLO
160 CHANNEL_RETIREMENT_EVENT | Channel retirement event | IGNORE | INVESTIGATE_SW
161 CHANNEL_RETIREMENT_FAILURE | Channel retirement failure | IGNORE | INVESTIGATE_SW
162 PSHC_REENGAGED | Power smoothing circuitry re-engaged
163 PSHC_DISENGAGED | Power smoothing circuitry disengaged
164 PSHC_LOW_LIFETIME | Power smoothing circuitry: low lifetime left
165 PSHC_ZERO_LIFETIME | Power smoothing circuitry: lifetime exhausted
166 NVLINK_SECURE_CRYPTO_ERR | NVLink traffic before encryption was set up
167 PCIE_FATAL_TIMEOUT | PCIe fatal timeout
168 REDUCED_GPU_MEMORY_CAPACITY | Errors in the write-protected region
169 SEC2_HALT_ERROR | Internal micro-controller (SEC2) halt
170 NVLINK_SECURE_OTHER | Interrupt in confidential-computing mode
171 UNCORRECTABLE_DRAM_ERROR | Detail of Xid 48: DRAM
172 UNCORRECTABLE_SRAM_ERROR | Detail of Xid 48: SRAM
"""

# The rows NVIDIA's GPU memory error management guide is also about (ECC, remapping,
# containment, page and resource retirement).
_MEMORY_ROWS = frozenset({48, 63, 64, 92, 94, 95, 140, 156, 157, 171, 172})
_READ_DIRECTLY = 13  # the last row read on NVIDIA's page itself
_MNEMONIC = re.compile(r"[A-Z][A-Z0-9_]*")
_BUCKETS = frozenset(member.value for member in Bucket)


def parse_catalogue(table: str) -> dict[int, XidEntry]:
    """The entries of ``table`` (the format of :data:`_TABLE`), Xids ascending; a malformed row
    raises ValueError naming it."""
    entries: dict[int, XidEntry] = {}
    for number, row in enumerate(table.strip().splitlines(), 1):
        head, *cells = (cell.strip() for cell in row.split("|"))
        xid, _, mnemonic = head.partition(" ")
        name, bucket, investigatory = [*cells, "", "", ""][:3]
        if not xid.isdigit() or int(xid) <= max(entries, default=0):
            problem = "the Xid is not a number above the previous row's"
        elif not _MNEMONIC.fullmatch(mnemonic) or not name or len(cells) > 3:
            problem = "want: xid MNEMONIC | name | immediate | investigatory"
        elif bucket not in _BUCKETS:
            problem = f"unknown bucket {bucket!r}"
        else:
            entries[int(xid)] = XidEntry(
                int(xid),
                mnemonic,
                name,
                Bucket(bucket),
                investigatory,
                memory=int(xid) in _MEMORY_ROWS,
                read_directly=int(xid) <= _READ_DIRECTLY,
            )
            continue
        raise ValueError(f"Xid table row {number}: {problem}: {row!r}")
    return entries


XID_CATALOGUE: Mapping[int, XidEntry] = parse_catalogue(_TABLE)


class XidAction(str, enum.Enum):
    """What gpuwatchd does about one Xid (docs/findings.md#xid-table)."""

    RESET = "reset"  # reset_required: drain, wait until nothing holds the GPU, reset
    REBOOT = "reboot"  # reboot_required: reboot or power-cycle; never a reset
    RECOVERY_ACTION = "recovery_action"  # the driver's recovery action field decides
    FABRIC_MANAGER = "fabric_manager"  # solo: points at Fabric Manager; else follow the others
    RESTART_APP = "restart_app"  # the job's fault: counted, never a GPU action
    IGNORE = "ignore"  # informational: counted
    REPORT = "report"  # no remedy the daemon can take: counted and named in the evidence

    def __str__(self) -> str:
        return self.value


_BY_BUCKET: Mapping[Bucket, XidAction] = {
    Bucket.RESET_GPU: XidAction.RESET,
    Bucket.WORKFLOW_XID_48: XidAction.RESET,  # solo: reset; with 63/64: drain and reset
    Bucket.WORKFLOW_NVLINK_ERR: XidAction.RESET,  # reset the GPU (or, if that fails, reboot)
    Bucket.RESTART_BM: XidAction.REBOOT,
    Bucket.RESTART_VM: XidAction.REBOOT,  # from inside the VM: restarting it is a reboot
    Bucket.XID_154: XidAction.RECOVERY_ACTION,
    Bucket.WORKFLOW_XID_45: XidAction.FABRIC_MANAGER,
    Bucket.RESTART_APP: XidAction.RESTART_APP,
    Bucket.IGNORE: XidAction.IGNORE,
    Bucket.CONTACT_SUPPORT: XidAction.REPORT,
    Bucket.CHECK_MECHANICALS: XidAction.REPORT,
    Bucket.UPDATE_SWFW: XidAction.REPORT,
    Bucket.CHECK_UVM: XidAction.REPORT,
    Bucket.WORKFLOW_NVLINK5_ERR: XidAction.REPORT,  # needs the kernel log's detail
    Bucket.NONE: XidAction.REPORT,
}

_WHAT: Mapping[XidAction, str] = {
    XidAction.RESET: "`reset_required`",
    XidAction.REBOOT: "`reboot_required`",
    XidAction.RECOVERY_ACTION: "the recovery action decides",
    XidAction.FABRIC_MANAGER: "solo: names Fabric Manager when the fabric is unhealthy",
    XidAction.RESTART_APP: "counted",
    XidAction.IGNORE: "counted",
    XidAction.REPORT: "counted, reported",
}


def xid_action(xid: int) -> XidAction:
    """What the daemon does about ``xid``; an Xid the catalogue does not list is reported."""
    entry = XID_CATALOGUE.get(xid)
    return XidAction.REPORT if entry is None else _BY_BUCKET[entry.immediate]


def render_markdown() -> str:
    """The Xid table of docs/findings.md, one row per catalogue entry (tests keep them equal);
    sources: [C] the catalogue (``*``: read on NVIDIA's page), [M] the memory guide."""
    lines = [
        "| Xid | mnemonic | name | immediate | investigatory | gpuwatchd | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for xid, entry in sorted(XID_CATALOGUE.items()):
        source = "[C]" + ("*" if entry.read_directly else "") + (" [M]" if entry.memory else "")
        bucket = f"`{entry.immediate.value}`" if entry.immediate.value else "*none given*"
        investigatory = entry.investigatory.replace("|", "/") or "*none given*"
        lines.append(
            f"| {xid} | `{entry.mnemonic}` | {entry.name} | {bucket} | "
            f"{investigatory} | {_WHAT[xid_action(xid)]} | {source} |"
        )
    return "\n".join(lines) + "\n"
