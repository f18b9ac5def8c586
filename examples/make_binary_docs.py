"""Generate the PDF and Word files of the sample corpus in examples/lab-docs, deterministically.

Run `python examples/make_binary_docs.py` after editing the texts below; the outputs are
committed, so a rerun must give byte-identical files (tests/test_examples_corpus.py checks).
PDFs are written by a tiny hand-rolled writer (standard Helvetica fonts, WinAnsi text, one
content stream per page) because no PDF library is a dependency; .docx files use python-docx.
"""

from __future__ import annotations

import argparse
import io
import zipfile
from datetime import datetime
from pathlib import Path

LAB_DOCS = Path(__file__).resolve().parent / "lab-docs"

# A document is a title plus blocks: ("h", text) heading, ("p", text) paragraph,
# ("li", text) bullet, ("table", [header, row, ...]) and ("pagebreak", "").
Block = tuple[str, object]

DOCS: dict[str, tuple[str, list[Block]]] = {}

# ---------------------------------------------------------------------------------- public

DOCS["public/maintenance-announcements.pdf"] = ("Basalt Maintenance Announcements", [
    ("p", "Research Computing takes the Basalt cluster down for planned maintenance once per "
          "quarter, on the second Tuesday of March, June, September and December. This page "
          "is the official announcement; the live status is on status.niqb.example.org."),
    ("h", "Next maintenance window"),
    ("p", "The next maintenance window is on Tuesday 11 March 2025, from 07:00 to 19:00. "
          "During the window the whole cluster is unavailable: login nodes, all partitions, "
          "and the /home, /project and /scratch filesystems. Globus transfers are paused and "
          "resume automatically afterwards."),
    ("h", "What this means for your jobs"),
    ("li", "From 4 March, jobs whose time limit would run past 07:00 on 11 March do not "
           "start. They stay pending with the reason ReqNodeNotAvail and start after the "
           "window. Shorten --time if you want a job to run before the maintenance."),
    ("li", "Jobs still running at 07:00 on 11 March are killed. Save checkpoints."),
    ("li", "Group reservations are released for the day of the maintenance."),
    ("h", "What changes"),
    ("p", "The scheduler and the GPU drivers are upgraded. After the maintenance the default "
          "CUDA module becomes cuda/12.4; cuda/12.2 stays available. Programs built against "
          "older CUDA versions keep working. Please report anything unusual to "
          "hpc-help@niqb.example.org."),
    ("h", "Later windows in 2025"),
    ("table", [["Date", "Time", "Notes"],
               ["Tue 10 June 2025", "07:00-19:00", "storage expansion"],
               ["Tue 9 September 2025", "07:00-19:00", "to be announced"],
               ["Tue 9 December 2025", "07:00-19:00", "to be announced"]]),
    ("h", "Previous window"),
    ("p", "The last maintenance took place on Tuesday 10 December 2024 and finished two hours "
          "early. It replaced the core InfiniBand switch firmware and added 2 PB to /scratch."),
])

DOCS["public/onboarding.docx"] = ("Getting Started with Research Computing at NIQB", [
    ("p", "Welcome to the Northlake Institute for Quantitative Biology. This checklist gets "
          "you from your first day to your first job on the Basalt cluster. Most newcomers "
          "finish it within a week."),
    ("h", "1. Request an account"),
    ("p", "Fill in the account request form ACC-REQ-7 on the account portal. Choose your "
          "research group; the group PI receives an e-mail and must approve the request. "
          "Accounts are created within two working days of approval, and you are added to "
          "your group's Unix group at the same time, which gives you access to the group's "
          "/project directory."),
    ("h", "2. Set up SSH keys and two-factor login"),
    ("p", "Create an SSH key pair (ssh-keygen -t ed25519) on your laptop and paste the public "
          "key into the account portal. Then enrol an authenticator app in the portal's "
          "security page. Both are needed before your first login; password logins are "
          "disabled."),
    ("h", "3. Take the Basalt 101 course"),
    ("p", "Basalt 101 is a three-hour hands-on introduction to Linux, Slurm and the storage "
          "rules. It runs on the first Tuesday of every month at 09:30 in the training room "
          "A204 and is required for new users before they may submit jobs larger than 64 "
          "cores or 1 GPU."),
    ("h", "4. Stay informed"),
    ("li", "You are subscribed to the basalt-users mailing list automatically; maintenance "
           "windows and outages are announced there."),
    ("li", "The user guide, partition limits and storage quotas are on the intranet."),
    ("li", "Office hours: Thursdays 14:00-16:00, room A204."),
    ("h", "5. Acknowledge the cluster"),
    ("p", "Please add this sentence to the acknowledgements of papers that used Basalt: "
          "\"Computations were performed on the Basalt cluster of the Northlake Institute for "
          "Quantitative Biology.\" Send the reference to hpc-help@niqb.example.org; the "
          "publication list supports the next hardware funding request."),
    ("h", "Leaving the institute"),
    ("p", "Accounts are locked 30 days after your contract ends. Move data you want to keep "
          "to your group's /project directory before then; your /home is deleted 90 days "
          "after the account is locked."),
])

# -------------------------------------------------------------------------------- genomics

DOCS["genomics/rnaseq-qc-report.pdf"] = ("RNA-seq Quality Control: Thresholds and Q4 2024 Report", [
    ("p", "Genomics Core, internal report. These are the acceptance thresholds for RNA "
          "samples and libraries, followed by the quality summary of the last quarter."),
    ("h", "Acceptance thresholds"),
    ("table", [["Metric", "Threshold", "Action if failed"],
               ["RIN (fresh frozen tissue, cells)", "RIN of 7.0 or higher",
                "reject, ask for re-extraction"],
               ["FFPE samples", "DV200 of 30% or higher", "use the FFPE protocol, warn the user"],
               ["Input amount", "500 ng total RNA", "use the low-input kit below 100 ng"],
               ["Reads per sample", "25 million read pairs", "top up on the next run"],
               ["Uniquely mapped (STAR)", "85% or higher", "check for contamination"],
               ["rRNA fraction", "below 5%", "repeat poly-A selection"]]),
    ("p", "Samples between RIN 6.0 and 7.0 may be sequenced only when the user signs the "
          "low-quality waiver; the report then carries a LOWRIN flag. Samples below RIN 6.0 "
          "are never sequenced with the standard mRNA protocol."),
    ("h", "Q4 2024 summary"),
    ("p", "The core received 412 RNA samples from 17 projects between October and December "
          "2024. 19 samples (4.6%) failed intake QC, 14 of them because of low RIN. Median "
          "RIN of accepted samples was 8.6. Median uniquely mapped rate was 91.2%."),
    ("p", "One run, RUN-2411-07, had low cluster occupancy (62%) because the pool was loaded "
          "at 120 pM instead of 150 pM. All 48 libraries of that run were topped up on "
          "RUN-2412-02 at no cost to the users, and the loading step in the sequencing "
          "protocol now requires a second person to check the dilution."),
    ("h", "Recommendations"),
    ("li", "Users should extract RNA within two weeks of sampling and store it at -80 C."),
    ("li", "Projects with FFPE material should contact the core before sending samples."),
    ("li", "Keep the thresholds unchanged for 2025; review again after Q2 2025."),
])

DOCS["genomics/grant-budget.docx"] = ("Genomics Core Budget Notes, FY2025", [
    ("p", "Internal to the Genomics Core. Fiscal year 1 January to 31 December 2025. "
          "Figures in EUR. Questions to the core manager (alice)."),
    ("h", "Funding sources and cost codes"),
    ("table", [["Cost code", "Source", "Use"],
               ["GEN-4471-R01", "Research grant 'Germline determinants of early-onset disease'",
                "sequencing reagents, flow cells, library kits, dry ice"],
               ["GEN-4471-EQ", "Same grant, equipment line", "instruments above 5,000"],
               ["GEN-RCH-09", "Core recharge account (user fees)",
                "service contracts, staff top-up"]]),
    ("p", "Sequencing reagents and flow cells for any project must be ordered on GEN-4471-R01; "
          "the cost is recovered from the user's project through the recharge account at the "
          "end of each quarter."),
    ("h", "Budget for 2025"),
    ("table", [["Item", "Budget", "Spent by 31 Jan"],
               ["Reagents and flow cells", "182,000", "24,300"],
               ["NovaSeq X Plus service contract", "64,500", "64,500"],
               ["Library prep robot consumables", "21,000", "2,150"],
               ["Storage above 50 TB on Basalt", "6,000", "0"],
               ["Conference travel", "8,000", "1,200"]]),
    ("h", "Rules for ordering"),
    ("li", "Orders above 5,000 need the core manager's approval before they are placed."),
    ("li", "A 10B flow cell costs about 7,900; plan runs so that flow cells are at least "
           "85% full."),
    ("li", "Compute on Basalt is free; only project storage above 50 TB is charged."),
    ("h", "Outlook"),
    ("p", "The grant's current period ends on 30 September 2026. The renewal application is "
          "due on 5 February 2026 and needs the core's usage statistics for 2025, so keep the "
          "LIMS project codes complete."),
])

# --------------------------------------------------------------------------------- imaging

DOCS["imaging/detector-calibration.pdf"] = ("Falcon 4i Detector: Gain References and Error Codes", [
    ("p", "Imaging Facility technical note for KRIOS-2. Applies to EPU 3.x with the Falcon 4i "
          "direct electron detector in counting mode, EER output."),
    ("h", "Gain reference schedule"),
    ("p", "A fresh gain reference is acquired every 14 days: during the monthly facility "
          "maintenance session and again in the middle of the month. EPU refuses to start an "
          "automated acquisition when the gain reference is older than 21 days. The current "
          "reference is stored in the EPU data folder and copied to "
          "/project/imaging/gainrefs with the date in the file name; always process EER data "
          "with the reference that was valid on the day of collection."),
    ("h", "Recommended exposure settings"),
    ("li", "Dose rate on the detector: about 8 electrons per pixel per second."),
    ("li", "Total dose: 40 to 50 electrons per square angstrom, saved as EER."),
    ("li", "EER fractionation for processing: 40 to 50 fractions of about 1 e/A2 each."),
    ("li", "Nominal pixel size for single particles: 0.73 A at 165,000x magnification."),
    ("h", "Error codes"),
    ("table", [["Code", "Meaning", "What to do"],
               ["EPU-E1042", "gain reference missing or older than 21 days",
                "acquire a new gain reference, or ask staff"],
               ["EPU-E2210", "autoloader cassette mapping failed", "re-run the inventory"],
               ["FC-TEMP-07", "Falcon sensor temperature out of range",
                "stop acquisition, call the on-call phone"]]),
    ("p", "EPU-E1042 is the most common error reported by users. It usually appears on the "
          "first session after a maintenance week. Users trained for unattended sessions may "
          "acquire the gain reference themselves: retract the specimen, set spot size 1 with "
          "a flat beam of 8 e/px/s and run the Falcon gain reference task for 60 seconds."),
    ("p", "FC-TEMP-07 must never be ignored: continuing to acquire can damage the sensor."),
])

DOCS["imaging/microscope-service-log.docx"] = ("KRIOS-2 and GLACIOS-1 Service Log", [
    ("p", "Service history of the facility's electron microscopes. Both instruments are "
          "covered by the manufacturer service contract SC-88213 (full parts and labour, two "
          "preventive maintenance visits per year, response within 48 hours). Contract "
          "costs are charged to the imaging cost centre IMG-2208."),
    ("h", "KRIOS-2 (Titan Krios G4, room C017)"),
    ("table", [["Date", "Work", "Downtime"],
               ["5 Nov 2024", "preventive maintenance visit, stage recalibrated", "2 days"],
               ["20 Jan 2025", "autoloader gripper replaced after cassette jam", "1 day"],
               ["3 Feb 2025", "FC-TEMP-07 alarms, Falcon chiller filter replaced", "6 hours"],
               ["7 Apr 2025", "next preventive maintenance visit (planned)", "2 days"]]),
    ("h", "GLACIOS-1 (room C015)"),
    ("table", [["Date", "Work", "Downtime"],
               ["12 Dec 2024", "preventive maintenance visit", "1 day"],
               ["14 Feb 2025", "column valve sticking, valve actuator replaced", "4 hours"]]),
    ("h", "How to log a fault"),
    ("p", "Open a service request in the manufacturer portal under contract SC-88213, attach "
          "the EPU log and the TEM server log, and add a line to this table. Tell the users "
          "with bookings in the next 48 hours; the facility manager decides whether to cancel "
          "them. Cancelled bookings because of faults are never charged."),
    ("h", "Notes"),
    ("p", "The cold FEG was flashed as scheduled every morning at 08:30. The service engineer "
          "recommends keeping the autoloader temperature log for the next visit, because the "
          "January cassette jam may have been caused by ice build-up."),
])

# ------------------------------------------------------------------------------ hpc-admins

DOCS["hpc-admins/maintenance-plan.pdf"] = ("Maintenance 11 March 2025: Detailed Plan (CHG-1187)", [
    ("p", "Change ticket CHG-1187. Owner: carol. Storage: Mateo. Approved by the change board "
          "on 18 February 2025. Window: Tuesday 11 March 2025, 07:00-19:00; users were told "
          "07:00-19:00, we aim to release at 17:00."),
    ("h", "Preparation (before the window)"),
    ("li", "4 March: create the maintenance reservation: scontrol create reservation "
           "reservationname=maint-0311 starttime=2025-03-11T07:00 duration=12:00:00 "
           "nodes=ALL flags=maint,ignore_jobs users=root"),
    ("li", "7 March: stage firmware images on the admin NFS share /admin/firmware/2025-03."),
    ("li", "10 March: confirm the vendor engineer for the gpu05 module swap (INC-2291, "
           "RMA-40981) and the replacement part on site."),
    ("h", "Schedule on the day"),
    ("table", [["Time", "Step", "Who"],
               ["07:00", "kill remaining jobs, stop slurmctld, unmount Lustre on clients", "carol"],
               ["07:15", "dump slurmdbd: /admin/backups/slurmdbd-20250311.sql.gz", "carol"],
               ["07:30", "BMC firmware 7.10.30 and BIOS 2.19.1 on gpu01-gpu08", "carol"],
               ["09:00", "NVIDIA driver 550.127.05 and DCGM 3.3.9 on gpu nodes", "carol"],
               ["09:00", "Lustre servers to 2.15.5, OST0007 disk check", "Mateo"],
               ["10:00", "Slurm 23.11.10 to 24.05.4: slurmdbd, then slurmctld, then slurmd",
                "carol"],
               ["11:00", "gpu05 SXM4 module swap by vendor engineer", "vendor"],
               ["13:00", "boot all nodes, NHC, dcgmi diag -r 3 on every GPU node", "carol"],
               ["15:00", "test jobs: MPI on cpu, NCCL all-reduce on gpu, Lustre IOR", "all"],
               ["16:00", "go/no-go decision", "carol"]]),
    ("p", "The BMC and BIOS update fixes the PCIe AER error storms seen on gpu03 and gpu06 in "
          "January. Update BMC first, then BIOS, one rack at a time; never flash both images "
          "of the dual-image BMC in the same step."),
    ("pagebreak", ""),
    ("h", "Rollback"),
    ("li", "Firmware: the BMC keeps the previous image in its second slot; switch back with the "
           "vendor tool (bmcflash --activate backup) and power-cycle the node."),
    ("li", "Driver: the previous driver 535.183.06 stays in the image as a boot entry."),
    ("li", "Slurm: if slurmdbd conversion fails, restore the 07:15 dump into a fresh MariaDB "
           "and reinstall 23.11.10 from the local repository; do not start slurmctld 24.05 "
           "against an unconverted database."),
    ("li", "gpu05: if the burn-in fails, leave the node drained and keep INC-2291 open."),
    ("h", "Go/no-go criteria at 16:00"),
    ("li", "All CPU nodes and at least seven GPU nodes pass NHC and the test jobs."),
    ("li", "Lustre IOR reaches at least 80% of the December baseline (38 GB/s write)."),
    ("li", "sacct shows jobs from before the window, proving the database conversion worked."),
    ("h", "Communication"),
    ("p", "Announcements went to basalt-users 14 days and 7 days before the window; the last "
          "reminder goes out on 10 March at 12:00. Update status.niqb.example.org at the "
          "start, at 12:00 and at release. Remove the maint-0311 reservation and restore the "
          "group reservations with the saved definitions in /admin/slurm/reservations before "
          "announcing the release."),
])

DOCS["hpc-admins/root-procedures.docx"] = ("Privileged Access and Break-Glass Procedures", [
    ("p", "Applies to members of hpc-admins. Last reviewed 20 January 2025 by carol. Read it "
          "once a quarter; the break-glass drill is part of every maintenance window."),
    ("h", "Normal privileged access"),
    ("p", "Nobody logs in as root directly. Each admin has a personal admin account "
          "(adm-NAME, e.g. adm-carol) that exists only on the admin jump host "
          "jump.admin.niqb.example.org. From there, use sudo -i on the target machine; the "
          "sudo rules come from FreeIPA and every privileged session is recorded with tlog "
          "and kept for one year."),
    ("h", "Break-glass root access"),
    ("p", "Use break-glass access only when FreeIPA or the jump host is down and the cluster "
          "needs an urgent fix, for example during a filesystem outage."),
    ("li", "The root password of the service nodes is in HashiCorp Vault at the path "
           "secret/hpc/breakglass; any two admins together can unseal it."),
    ("li", "If Vault is unavailable, a sealed envelope with the password is kept in the safe "
           "of room A101; the facilities night desk holds the key and logs who took it."),
    ("li", "Two-person rule: a second admin must be on the phone or in the room for the "
           "whole session."),
    ("li", "Open a ticket with the prefix BG- within one hour, listing every command run."),
    ("li", "Rotate the root password afterwards with /admin/bin/rotate-root.sh, which updates "
           "Vault and prints a new envelope sheet."),
    ("h", "BMC and console access"),
    ("p", "BMC interfaces are on the management VLAN 40 and reachable only from the jump "
          "host. BMC credentials are in Vault at secret/hpc/bmc. Use the serial-over-LAN "
          "console (ipmitool sol activate) when a node does not answer on the network."),
    ("h", "Offboarding an admin"),
    ("p", "When an admin leaves, disable the adm- account on the same day, remove the person "
          "from the Vault policy hpc-admins and rotate the break-glass password within one "
          "week."),
])

# ------------------------------------------------------------------------------ PDF writer

# Helvetica glyph widths (1/1000 em) from the standard AFM, for line wrapping.
_WIDTHS = dict(zip(
    " !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
    "abcdefghijklmnopqrstuvwxyz{|}~",
    [278, 278, 355, 556, 556, 889, 667, 191, 333, 333, 389, 584, 278, 333, 278, 278,
     556, 556, 556, 556, 556, 556, 556, 556, 556, 556, 278, 278, 584, 584, 584, 556, 1015,
     667, 667, 722, 722, 667, 611, 778, 722, 278, 500, 667, 556, 833, 722, 778, 667, 778,
     722, 667, 611, 722, 667, 944, 667, 667, 611, 278, 278, 278, 469, 556, 333,
     556, 556, 500, 556, 556, 278, 556, 556, 222, 222, 500, 222, 833, 556, 556, 556, 556,
     333, 500, 278, 556, 500, 722, 500, 500, 500, 334, 260, 334, 584], strict=True))

PAGE_W, PAGE_H, MARGIN = 612, 792, 72


def _text_width(text: str, size: float, bold: bool) -> float:
    width = sum(_WIDTHS.get(c, 556) for c in text) * size / 1000
    return width * 1.06 if bold else width  # bold glyphs are a little wider


def _wrap(text: str, size: float, bold: bool, max_width: float) -> list[str]:
    """Greedy word wrap; never breaks inside a word, so codes like gpu07-gpu08 stay whole."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if line and _text_width(candidate, size, bold) > max_width:
            lines.append(line)
            line = word
        else:
            line = candidate
    if line:
        lines.append(line)
    return lines


def _pdf_string(text: str) -> bytes:
    raw = text.encode("cp1252")
    return b"(" + raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def _layout(title: str, blocks: list[Block]) -> list[list[tuple[str, float, float, float, str]]]:
    """Place lines on pages: each line is (font, size, x, y, text)."""
    pages: list[list[tuple[str, float, float, float, str]]] = [[]]
    y = PAGE_H - MARGIN
    width = PAGE_W - 2 * MARGIN

    def emit(text: str, font: str, size: float, indent: float = 0.0, gap: float = 0.0) -> None:
        nonlocal y
        leading = size * 1.35
        y -= gap
        for line in _wrap(text, size, font == "F2", width - indent):
            if y - leading < MARGIN:
                pages.append([])
                y = PAGE_H - MARGIN
            y -= leading
            pages[-1].append((font, size, MARGIN + indent, y, line))

    emit(title, "F2", 16)
    y -= 6
    for kind, content in blocks:
        if kind == "h":
            emit(str(content), "F2", 12.5, gap=8)
        elif kind == "p":
            emit(str(content), "F1", 10.5, gap=4)
        elif kind == "li":
            emit("- " + str(content), "F1", 10.5, indent=12, gap=2)
        elif kind == "table":
            rows = list(content)  # type: ignore[call-overload]
            y -= 4
            emit("  |  ".join(rows[0]), "F2", 10)
            for row in rows[1:]:
                emit("  |  ".join(row), "F1", 10, indent=6)
        elif kind == "pagebreak":
            pages.append([])
            y = PAGE_H - MARGIN
        else:
            raise ValueError(f"unknown block kind {kind!r}: use h, p, li, table or pagebreak")
    return pages


def build_pdf(title: str, blocks: list[Block]) -> bytes:
    """Return a minimal, valid PDF 1.4 file with the document's text."""
    pages = _layout(title, blocks)
    num_pages = len(pages)
    first_page = 5  # objects: 1 catalog, 2 pages, 3-4 fonts, then page/content pairs, info
    page_ids = [first_page + 2 * i for i in range(num_pages)]
    info_id = first_page + 2 * num_pages
    objects: dict[int, bytes] = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % i for i in page_ids)
        + b"] /Count %d >>" % num_pages,
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
        4: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica-Bold "
           b"/Encoding /WinAnsiEncoding >>",
        info_id: b"<< /Title " + _pdf_string(title)
        + b" /Producer (examples/make_binary_docs.py) >>",
    }
    for page_id, lines in zip(page_ids, pages, strict=True):
        ops = [
            b"BT /%s %g Tf 1 0 0 1 %g %g Tm %s Tj ET"
            % (font.encode(), size, x, y, _pdf_string(text))
            for font, size, x, y, text in lines
        ]
        stream = b"\n".join(ops) + b"\n"
        objects[page_id] = (
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] " % (PAGE_W, PAGE_H)
            + b"/Resources << /Font << /F1 3 0 R /F2 4 0 R >> >> /Contents %d 0 R >>"
            % (page_id + 1)
        )
        objects[page_id + 1] = (
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"endstream"
        )

    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets: dict[int, int] = {}
    for num in sorted(objects):
        offsets[num] = len(out)
        out += b"%d 0 obj\n" % num + objects[num] + b"\nendobj\n"
    xref_at = len(out)
    size = max(objects) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for num in range(1, size):
        out += b"%010d 00000 n \n" % offsets[num]
    out += b"trailer\n<< /Size %d /Root 1 0 R /Info %d 0 R >>\n" % (size, info_id)
    out += b"startxref\n%d\n%%%%EOF\n" % xref_at
    return bytes(out)


# ----------------------------------------------------------------------------- DOCX writer

_FIXED_TIME = datetime(2025, 3, 1, 12, 0, 0)


def build_docx(title: str, blocks: list[Block]) -> bytes:
    """Return a .docx with a title, headings, paragraphs, bullets and tables."""
    try:
        import docx
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("python-docx is missing: pip install 'unstructured[docx]'") from e

    document = docx.Document()
    props = document.core_properties
    props.title = title
    props.author = "NIQB"
    props.last_modified_by = "NIQB"
    props.created = props.modified = _FIXED_TIME
    props.revision = 1
    document.add_heading(title, level=0)
    for kind, content in blocks:
        if kind == "h":
            document.add_heading(str(content), level=1)
        elif kind == "p":
            document.add_paragraph(str(content))
        elif kind == "li":
            document.add_paragraph(str(content), style="List Bullet")
        elif kind == "table":
            rows = list(content)  # type: ignore[call-overload]
            table = document.add_table(rows=len(rows), cols=len(rows[0]))
            table.style = "Table Grid"
            for r, row in enumerate(rows):
                for c, cell in enumerate(row):
                    table.cell(r, c).text = cell
        elif kind == "pagebreak":
            document.add_page_break()
        else:
            raise ValueError(f"unknown block kind {kind!r}: use h, p, li, table or pagebreak")

    buffer = io.BytesIO()
    document.save(buffer)
    return _normalize_zip(buffer.getvalue())


def _normalize_zip(data: bytes) -> bytes:
    """Rewrite a zip with fixed timestamps so that reruns give byte-identical files."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            info = zipfile.ZipInfo(item.filename, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            dst.writestr(info, src.read(item.filename))
    return out.getvalue()


def build(relpath: str) -> bytes:
    """Return the bytes of one generated file, by its path relative to lab-docs."""
    title, blocks = DOCS[relpath]
    if relpath.endswith(".pdf"):
        return build_pdf(title, blocks)
    if relpath.endswith(".docx"):
        return build_docx(title, blocks)
    raise ValueError(f"cannot generate {relpath!r}: only .pdf and .docx are generated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=LAB_DOCS,
                        help="directory to write into (default: examples/lab-docs)")
    args = parser.parse_args()
    for relpath in sorted(DOCS):
        target = args.out / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(build(relpath))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
