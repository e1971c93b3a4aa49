"""bench/sass.py on a small hand-written listing (the shape ``cuobjdump -sass`` prints)."""

from bench import sass

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x0 */
        /*0010*/              @!P0 BRA 0x0090 ;                                /* 0x0 */
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;                /* 0x0 */
        /*0030*/                   MUFU.EX2 R3, R2 ;                           /* 0x0 */
        /*0040*/                   MUFU.RCP R6, R3 ;                           /* 0x0 */
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;               /* 0x0 */
        /*0060*/                   STG.E desc[UR4][R4.64], R6 ;                /* 0x0 */
        /*0070*/               @P1 BRA 0x0020 ;                                /* 0x0 */
        /*0080*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;          /* 0x0 */
        /*0090*/                   EXIT ;                                      /* 0x0 */
        /*00a0*/                   BRA 0xa0;                                   /* 0x0 */
"""


def test_loop_body_is_the_backward_branch_span():
    body, loops = sass.loop_body(sass.instructions(LISTING))
    assert loops == 1
    assert [sass.opcode(t) for t in body] == ["LDG.E", "MUFU.EX2", "MUFU.RCP",
                                               "BAR.SYNC.DEFER_BLOCKING", "STG.E", "BRA"]


def test_costs_per_element_and_per_iteration():
    # 6 instructions an iteration, 32 threads over 64 elements: 3 per element
    c = sass.costs(LISTING, elements=64, threads=32)
    assert c["instr"] == 3.0 and c["ex2"] == 0.5 and c["rcp"] == 0.5 and c["lg2"] == 0.0
    assert c["rsq"] == 0.0
    rsq = sass.costs(LISTING.replace("MUFU.RCP", "MUFU.RSQ"), elements=64, threads=32)
    assert rsq["rsq"] == 0.5 and rsq["rcp"] == 0.0
    assert (c["bar"], c["shfl"], c["ldg"], c["stg"], c["loop"]) == (1, 0, 1, 1, True)


def test_without_a_loop_the_whole_kernel_counts():
    straight = "\n".join(line for line in LISTING.splitlines() if "@P1 BRA" not in line)
    c = sass.costs(straight, elements=1, threads=1)
    assert not c["loop"] and c["instr"] == 9.0 and c["shfl"] == 1   # through EXIT


# Two loops in a row, the first wider (3 instructions and its branch) than the second (1 and
# its branch), and a loop inside the first.
TWO_LOOPS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x0 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;                /* 0x0 */
        /*0020*/                   MUFU.EX2 R3, R2 ;                           /* 0x0 */
        /*0030*/               @P2 BRA 0x0020 ;                                /* 0x0 */
        /*0040*/               @P1 BRA 0x0010 ;                                /* 0x0 */
        /*0050*/                   STG.E desc[UR4][R4.64], R6 ;                /* 0x0 */
        /*0060*/               @P1 BRA 0x0050 ;                                /* 0x0 */
        /*0070*/                   EXIT ;                                      /* 0x0 */
        /*0080*/                   BRA 0x80;                                   /* 0x0 */
"""


def test_the_last_of_loops_in_a_row_is_taken_on_request():
    """By default the widest loop; with ``last`` the last loop not inside another (the
    chained forward's second walk), not the loop inside the first."""
    ins = sass.instructions(TWO_LOOPS)
    widest, loops = sass.loop_body(ins)
    assert loops == 3 and [sass.opcode(t) for t in widest][0] == "LDG.E" and len(widest) == 4
    last, _ = sass.loop_body(ins, last=True)
    assert [sass.opcode(t) for t in last] == ["STG.E", "BRA"]
    assert sass.costs(TWO_LOOPS, elements=1, threads=1, last=True)["stg"] == 1


def test_inside_a_loop_over_everything_the_last_loop_inside_it_is_taken():
    """A persistent kernel (the chained kernels with ``PERSISTENT``): one loop over tickets
    holds the walks; ``last`` takes the last loop inside it, as without that loop."""
    wrapped = TWO_LOOPS.replace(
        "/*0070*/                   EXIT ;", "/*0070*/               @P3 BRA 0x0000 ;").replace(
        "/*0080*/                   BRA 0x80;", "/*0080*/                   EXIT ;")
    ins = sass.instructions(wrapped)
    last, loops = sass.loop_body(ins, last=True)
    assert loops == 4 and [sass.opcode(t) for t in last] == ["STG.E", "BRA"]
