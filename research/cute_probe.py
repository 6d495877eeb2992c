"""CuTe DSL probe: persistent Hopper GEMMs (D = act(A @ B), fp16 in, fp32 accumulate, fp16
out), written for epifuse's question "does a CuTe DSL backend reach what Triton and Gluon cannot"
(NOTEBOOK.md, "What limits each miss"). It measures what Gluon 3.6 does not expose: thread-block
clusters whose CTAs share one TMA load of A or B through multicast, so L2 delivers fewer bytes
per tile under the power limit; and a ping-pong schedule written by hand.

The kernels, one CTA of three warpgroups per SM (persistent, static tile schedule):
- warp 0 loads A and B tiles with TMA into a ring of shared-memory stages; in a cluster of
  (cm, cn) CTAs each CTA loads 1/cn of its A tile and 1/cm of its B tile and multicasts them to
  the CTAs of its cluster row or column;
- cooperative: two consumer warpgroups run WGMMA on one 128x256 tile (64 rows each) as its
  stages land, then write it in 128x32 pieces: registers -> activation -> fp16 -> shared memory
  (stmatrix) -> TMA store, 4 pieces in flight, while warp 0 already loads the next tile;
- ping-pong: each consumer warpgroup owns every other 128x128 tile and writes it while the
  other multiplies; the two take turns at their main loops.
Variants: `_grouped` walks the tiles in Triton's grouped order; `_nocluster` launches without a
cluster attribute. Launched as (1, 1, 1) clusters, the ping-pong's reads were merged by L2's
request coalescer far less often (13 % against 43 % launched plainly; presumably the CTAs land
on other SMs), which left it L2-bound (NOTEBOOK.md, 2026-11-26 12:32-12:49).
Results: NOTEBOOK.md 2026-11-26 11:02, 11:19 and 12:32-12:49, cute_probe_*.json, ncu_cute_probe_*.txt,
ncu_lrc_*.txt. For ncu: `ncu --profile-from-start off ... python -m research.cute_probe --profile
--configs A,B [--gluon "<epifuse kernel repr>;..."]`.

It is not wired into epifuse's kernel selection: nvidia-cutlass-dsl is not a dependency, and this
file only runs where it is importable. The GPU image lacks it and cannot download it;
research/carry.sh packs it here into two halves and unpacks them there, in two calls
made back to back on one warm machine:
    bash research/carry.sh pack cute                             # here, once
    bash research/carry.sh first cute                            # call 1, carry .cute1
    source research/carry.sh second cute && \\
        python -m research.cute_probe --shapes S1,S2,S3 --epifuse --out $OUT   # call 2, carry .cute2
CPU, compile only (checks the kernels build for sm_90a without a GPU):
    CUTE_DSL_ARCH=sm_90a PYTHONPATH=...:. python -m research.cute_probe --compile-only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from bench.workloads import identity

SHAPES = {"S1": (4096, 4096, 4096), "S2": (16384, 4096, 1024), "S3": (8192, 8192, 8192)}
CONFIGS = {  # name: PersistentGemm's arguments besides the activation
    "coop128x256_c1x1": dict(tile_mn=(128, 256)),
    "coop128x256_c2x1": dict(tile_mn=(128, 256), cluster_mn=(2, 1)),
    "coop128x256_c1x2": dict(tile_mn=(128, 256), cluster_mn=(1, 2)),
    "pp128x128_c1x1": dict(tile_mn=(128, 128), pingpong=True),
    "pp128x128_c2x1": dict(tile_mn=(128, 128), cluster_mn=(2, 1), pingpong=True),
    "coop128x256_c1x1_grouped": dict(tile_mn=(128, 256), grouped=True),
    "pp128x128_c1x1_grouped": dict(tile_mn=(128, 128), pingpong=True, grouped=True),
    "coop128x256_nocluster": dict(tile_mn=(128, 256), cluster_launch=False),
    "pp128x128_nocluster": dict(tile_mn=(128, 128), pingpong=True, cluster_launch=False),
    "coop128x256_nocluster_grouped": dict(tile_mn=(128, 256), cluster_launch=False, grouped=True),
    "pp128x128_nocluster_grouped": dict(tile_mn=(128, 128), pingpong=True, cluster_launch=False, grouped=True),
}
ACTIVATIONS = ("identity", "gelu")
SMEM_BYTES = 227 * 1024
THREADS_PER_WARPGROUP = 128


class PersistentGemm:
    """D[M, N] = act(A[M, K] @ B[K, N]); A K-major, B N-major (torch's row-major B), D N-major.

    Cooperative (`pingpong=False`): both consumer warpgroups work on one tile, 64 rows each, and
    write it together. Ping-pong: each consumer warpgroup owns every other tile of its CTA, so
    one writes its tile while the other multiplies the next."""

    def __init__(self, tile_mn=(128, 256), cluster_mn=(1, 1), pingpong=False, activation="identity",
                 epi_n=32, epi_stages=4, group=8, grouped=False, cluster_launch=True):
        self.tile_m, self.tile_n = tile_mn
        self.cluster_mn = cluster_mn
        # grouped: tiles in Triton's order (runs of `group` tile rows, walked along N) instead of
        # the DSL scheduler's (runs of `group` tile columns, walked along M); 1x1 clusters only
        assert not grouped or cluster_mn == (1, 1)
        self.grouped = grouped
        # cluster_launch=False: a plain launch (no cluster attribute); 1x1 clusters only
        assert cluster_launch or cluster_mn == (1, 1)
        self.cluster_launch = cluster_launch
        self.pingpong = pingpong
        self.activation = activation
        self.epi_tile = (self.tile_m, epi_n)
        self.epi_stages = epi_stages
        self.group = group
        self.mma_groups = 1 if pingpong else self.tile_m // 64  # warpgroups that share one tile
        self.teams = 2 if pingpong else 1  # consumer teams, each with tiles of its own
        self.threads = THREADS_PER_WARPGROUP * (1 + self.mma_groups * self.teams)

    def _plan(self, a_dtype, b_dtype, d_dtype, a_major, b_major, d_major):
        """Everything static that depends on the operands: the MMA, tile K, stage count and
        the shared-memory layouts."""
        self.mma = sm90.make_trivial_tiled_mma(
            a_dtype, b_dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
            cutlass.Float32, (self.mma_groups, 1, 1), tiler_mn=(64, self.tile_n))
        tile_k = cute.size(self.mma.shape_mnk, mode=[2]) * 4
        self.tile = (self.tile_m, self.tile_n, tile_k)
        stage_bytes = (self.tile_m + self.tile_n) * tile_k * a_dtype.width // 8
        d_buffers = self.epi_stages * self.teams  # each team stores from buffers of its own
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * d_dtype.width // 8 * d_buffers
        self.stages = (SMEM_BYTES - epi_bytes - 1024) // stage_bytes
        self.a_layout = sm90.make_smem_layout_a(a_major, self.tile, a_dtype, self.stages)
        self.b_layout = sm90.make_smem_layout_b(b_major, self.tile, b_dtype, self.stages)
        self.d_layout = sm90.make_smem_layout_epi(d_dtype, d_major, self.epi_tile, d_buffers)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor,
                 max_clusters: cutlass.Constexpr, stream):
        self.ab_dtype = a.element_type
        self.d_dtype = d.element_type
        self.d_major = LayoutEnum.from_tensor(d)
        self._plan(a.element_type, b.element_type, d.element_type,
                   LayoutEnum.from_tensor(a), LayoutEnum.from_tensor(b), self.d_major)
        cm, cn = self.cluster_mn
        load_a = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if cn > 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp())
        load_b = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if cm > 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp())
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_a, a, cute.slice_(self.a_layout, (None, None, 0)),
            (self.tile[0], self.tile[2]), num_multicast=cn)
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_b, b, cute.slice_(self.b_layout, (None, None, 0)),
            (self.tile[1], self.tile[2]), num_multicast=cm)
        tma_d, tD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), d,
            cute.slice_(self.d_layout, (None, None, 0)), self.epi_tile)

        tiles = cute.zipped_divide(d, tiler=(self.tile[0], self.tile[1]))[(0, (None, None, None))].shape
        # grouped: the scheduler walks the tiles column by column and _grouped_tile reorders them
        schedule = utils.PersistentTileSchedulerParams(tiles, (cm, cn, 1), 1 if self.grouped else self.group, True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(schedule, max_clusters)

        @cute.struct
        class Shared:
            load_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            turn_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_layout)], 1024]

        self.shared = Shared
        self.kernel(tma_a, tA, tma_b, tB, tma_d, tD, self.mma, cute.make_layout((cm, cn, 1)),
                    self.a_layout, self.b_layout, self.d_layout, schedule).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(cm, cn, 1) if self.cluster_launch else None, min_blocks_per_mp=1,
            stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD: cute.Tensor, mma: cute.TiledMma, cluster: cute.Layout,
               a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
               d_layout: cute.ComposedLayout, schedule: utils.PersistentTileSchedulerParams):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        cm, cn = self.cluster_mn
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        where = cluster.get_flat_coord(rank)
        # A is shared by the CTAs of a cluster row (same M, other N), B by those of a column
        a_peers = cute.make_layout_image_mask(cluster, where, mode=1) if cn > 1 else 0
        b_peers = cute.make_layout_image_mask(cluster, where, mode=0) if cm > 1 else 0

        storage = SmemAllocator().allocate(self.shared)
        stage_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_layout, (None, None, 0)))
                       + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_layout, (None, None, 0))))
        consumer_warps = self.mma_groups * 4  # the warps that read one stage
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.load_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # every consumer warp frees a stage in each CTA that multicast into it
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * (cm + cn - 1)),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, cm, cn, 1)), defer_sync=True)
        # Ping-pong teams take turns at their main loops. Without turns, a team that skips
        # the other's tile would wait on a stage's barrier many phases ahead of the loader,
        # and a barrier's phase parity cannot tell those phases apart.
        turns = [pipeline.PipelineOrder.create(
            barrier_storage=storage.turn_barriers.data_ptr(), depth=1, length=2, group_id=team,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS_PER_WARPGROUP),
            defer_sync=True) for team in range(self.teams)] if self.teams == 2 else [None]
        pipeline.pipeline_init_arrive(cluster_shape_mn=(cm, cn), is_relaxed=True)

        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sD = storage.sD.get_tensor(d_layout.outer, swizzle=d_layout.inner)
        # (tile, tile, tiles along M or N, tiles along K, L)
        gA = cute.local_tile(mA, (self.tile[0], self.tile[2]), (None, None, None))
        gB = cute.local_tile(mB, (self.tile[1], self.tile[2]), (None, None, None))
        gD = cute.local_tile(mD, (self.tile[0], self.tile[1]), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, where[1], cute.make_layout(cn), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, where[0], cute.make_layout(cm), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        pipeline.pipeline_init_wait(cluster_shape_mn=(cm, cn))

        if warpgroup == 0:
            cute.arch.warpgroup_reg_dealloc(40)
            if warp == 0:
                self.load_tiles(tma_a, tma_b, tAsA, tAgA, tBsB, tBgB, a_peers, b_peers, loads,
                                schedule, k_tiles)
        elif warpgroup <= self.mma_groups:
            cute.arch.warpgroup_reg_alloc(232)
            self.multiply_and_store(mma, sA, sB, sD, gD, tma_d, loads, turns[0], schedule, k_tiles,
                                    tidx - THREADS_PER_WARPGROUP, warp, 0)
        else:
            cute.arch.warpgroup_reg_alloc(232)
            self.multiply_and_store(mma, sA, sB, sD, gD, tma_d, loads, turns[-1], schedule, k_tiles,
                                    tidx - 2 * THREADS_PER_WARPGROUP, warp, 1)

    def activate(self, x):
        return _gelu_tanh(x) if self.activation == "gelu" else x

    @cute.jit
    def load_tiles(self, tma_a, tma_b, tAsA, tAgA, tBsB, tBgB, a_peers, b_peers, loads, schedule,
                   k_tiles):
        scheduler = utils.StaticPersistentTileScheduler.create(
            schedule, cute.arch.block_idx(), cute.arch.grid_dim())
        work = scheduler.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        while work.is_valid_tile:
            m, n, l = work.tile_idx
            if cutlass.const_expr(self.grouped):
                m, n = _grouped_tile(m, n, cute.size(tAgA, mode=[1]), cute.size(tBgB, mode=[1]), self.group)
            a_tiles = tAgA[(None, m, None, l)]
            b_tiles = tBgB[(None, n, None, l)]
            for k in range(k_tiles):
                loads.producer_acquire(state)
                landed = loads.producer_get_barrier(state)
                cute.copy(tma_a, a_tiles[(None, k)], tAsA[(None, state.index)],
                          tma_bar_ptr=landed, mcast_mask=a_peers)
                cute.copy(tma_b, b_tiles[(None, k)], tBsB[(None, state.index)],
                          tma_bar_ptr=landed, mcast_mask=b_peers)
                loads.producer_commit(state)
                state.advance()
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
        loads.producer_tail(state)

    @cute.jit
    def multiply_and_store(self, mma, sA, sB, sD, gD, tma_d, loads, turn, schedule, k_tiles, consumer_tidx,
                           warp, team: cutlass.Constexpr):
        """One team's tiles: every tile of the CTA (cooperative), or every other (ping-pong);
        `consumer_tidx` counts from the team's first thread."""
        team_threads = self.mma_groups * THREADS_PER_WARPGROUP
        store_warp = (1 + team * self.mma_groups) * 4  # the team's first warp issues its TMA stores
        thread_mma = mma.get_slice(consumer_tidx // THREADS_PER_WARPGROUP * THREADS_PER_WARPGROUP)
        fA = mma.make_fragment_A(thread_mma.partition_A(sA))
        fB = mma.make_fragment_B(thread_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thread_mma.partition_C(gD).shape[:3], cutlass.Float32)
        k_blocks = cute.size(fA, mode=[2])

        # registers -> shared memory through stmatrix, in the accumulator's thread layout
        to_smem = cute.make_tiled_copy_S(
            sm90.sm90_get_smem_store_op(self.d_major, elem_ty_d=self.d_dtype, elem_ty_acc=cutlass.Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_major.is_m_major_c(), 4),
                                    self.d_dtype), mma))
        thread_store = to_smem.get_slice(consumer_tidx)
        piece_dst = thread_store.partition_D(sD)
        acc_pieces = to_smem.retile(acc)
        piece_shape = cute.shape(thread_store.partition_S(sD))[:3]
        piece_f32 = cute.make_rmem_tensor(piece_shape, cutlass.Float32)
        piece_out = cute.make_rmem_tensor(piece_shape, self.d_dtype)
        values = cute.size(piece_shape[0])
        consumers = pipeline.NamedBarrier(barrier_id=1 + team, num_threads=team_threads)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, team_threads))

        scheduler = utils.StaticPersistentTileScheduler.create(
            schedule, cute.arch.block_idx(), cute.arch.grid_dim())
        work = scheduler.initial_work_tile_info()
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        free = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        turn_state = pipeline.PipelineState(1, cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(team == 0))
        if cutlass.const_expr(team == 1):  # the other team's first tile, and its stages
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
            for _ in range(k_tiles):
                read.advance()
                free.advance()
        while work.is_valid_tile:
            m, n, l = work.tile_idx
            if cutlass.const_expr(self.grouped):
                m, n = _grouped_tile(m, n, cute.size(gD, mode=[2]), cute.size(gD, mode=[3]), self.group)
            tile_d = gD[(None, None, m, n, l)]
            acc.fill(0.0)
            mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            # The stages' states advance in this body, not in a helper: a state that a called
            # function advances is not carried to the loop's next iteration.
            if cutlass.const_expr(self.teams == 2):
                turn.wait(turn_state)
            loads.consumer_wait(read)
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(mma, acc, fA[(None, None, kb, read.index)], fB[(None, None, kb, read.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            for k in range(1, k_tiles):
                loads.consumer_wait(read)
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(mma, acc, fA[(None, None, kb, read.index)], fB[(None, None, kb, read.index)], acc)
                cute.nvgpu.warpgroup.commit_group()
                read.advance()
                cute.nvgpu.warpgroup.wait_group(1)  # the previous stage's WGMMAs have finished
                loads.consumer_release(free)
                free.advance()
            if cutlass.const_expr(self.teams == 2):
                # every stage of this tile has landed: the other team's turn. The state advances
                # here (arrive would advance the copy): a loop carries only what its body advances
                turn.arrive(turn_state.clone())
                turn_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            loads.consumer_release(free)
            free.advance()

            pieces_d = cute.zipped_divide(tile_d, self.epi_tile)
            smem_pieces, gmem_pieces = cute.nvgpu.cpasync.tma_partition(
                tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), pieces_d)
            n_pieces = cute.size(pieces_d, mode=[1])
            piece_grid = cute.make_layout(pieces_d.shape[1], stride=(pieces_d.shape[1][1], 1))
            before = scheduler.num_tiles_executed * n_pieces
            for p in cutlass.range_constexpr(n_pieces):
                # a piece is (stmatrix values, 64-row halves, 16-column groups); the retiled
                # accumulator is ((values, all column groups), halves, 1)
                for m in cutlass.range_constexpr(piece_shape[1]):
                    for n in cutlass.range_constexpr(piece_shape[2]):
                        for v in cutlass.range_constexpr(values):
                            piece_f32[(v, m, n)] = acc_pieces[((v, p * piece_shape[2] + n), m, 0)]
                piece_out.store(self.activate(piece_f32.load()).to(self.d_dtype))
                buffer = team * self.epi_stages + (before + p) % self.epi_stages
                cute.copy(to_smem, piece_out, piece_dst[(None, None, None, buffer)])
                cute.arch.fence_proxy("async.shared", space="cta")
                consumers.arrive_and_wait()
                if warp == store_warp:
                    cute.copy(tma_d, smem_pieces[(None, buffer)], gmem_pieces[(None, piece_grid.get_hier_coord(p))])
                    stores.producer_commit()
                    stores.producer_acquire()
                consumers.arrive_and_wait()
            if cutlass.const_expr(self.teams == 2):  # skip the other team's next tile
                for _ in range(k_tiles):
                    read.advance()
                    free.advance()
            scheduler.advance_to_next_work(advance_count=self.teams)
            work = scheduler.get_current_work()
        stores.producer_tail()


@cute.jit
def _grouped_tile(m, n, num_m, num_n, group: cutlass.Constexpr):
    """The scheduler's column-major tile (m, n) renumbered in Triton's grouped order."""
    tile = m + n * num_m
    in_group = group * num_n
    first_m = tile // in_group * group
    rows = cutlass.min(num_m - first_m, group)
    return first_m + tile % in_group % rows, tile % in_group // rows


@cute.jit
def _gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + cute.math.tanh(inner, fastmath=True))


def _views(a, b, d):
    """torch A (M, K), B (K, N), D (M, N) as the (rows, cols, 1) CuTe tensors the kernel reads."""
    from cutlass.cute.runtime import from_dlpack
    (M, K), N = a.shape, b.shape[1]
    return (from_dlpack(a.as_strided((M, K, 1), (K, 1, M * K)), assumed_align=16),
            from_dlpack(b.as_strided((N, K, 1), (1, N, N * K)), assumed_align=16),
            from_dlpack(d.as_strided((M, N, 1), (N, 1, M * N)), assumed_align=16))


def _gemm_for(config, activation):
    gemm = PersistentGemm(activation=activation, **CONFIGS[config])
    return gemm, gemm.cluster_mn[0] * gemm.cluster_mn[1]


def compile_offline(config, activation, shape):
    """Compile for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a), with fake tensors of `shape`."""
    from cutlass.cute.runtime import make_fake_tensor
    from cuda.bindings import driver
    M, N, K = shape
    a = make_fake_tensor(cutlass.Float16, (M, K, 1), (K, 1, M * K), assumed_align=16)
    b = make_fake_tensor(cutlass.Float16, (N, K, 1), (1, N, N * K), assumed_align=16)
    d = make_fake_tensor(cutlass.Float16, (M, N, 1), (N, 1, M * N), assumed_align=16)
    gemm, cluster_size = _gemm_for(config, activation)
    return cute.compile(gemm, a, b, d, 132 // cluster_size, driver.CUstream(0))


def _epifuse_gelu(accum):
    D = gelu(accum, approximate="tanh")  # noqa: F821 - parsed by epifuse, never run
    return D


def _compile_on_gpu(config, activation, views):
    """The kernel of `config` compiled for the current GPU and stream, for tensors like `views`:
    (compiled, stream, clusters, compile seconds)."""
    import torch
    from cuda.bindings import driver
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    gemm, cluster_size = _gemm_for(config, activation)
    clusters = utils.HardwareInfo().get_max_active_clusters(cluster_size)
    start = time.perf_counter()
    compiled = cute.compile(gemm, *views, clusters, stream)
    return compiled, stream, clusters, time.perf_counter() - start


def _rel_err(out, expect):
    return ((out.double() - expect).norm() / expect.norm()).item()


def _unit_scale_error(compiled, a, b, activation, stream):
    """The kernel's relative error against float64 on A scaled by 1/sqrt(K), where the products
    are about unit size: at the timed inputs' scale (products of size sqrt(K)) GELU is ReLU to
    within fp16 rounding, so only this check tells a wrong GELU from a right one."""
    import torch
    a = (a.float() / a.shape[1] ** 0.5).half()
    d = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device, dtype=torch.float16)
    compiled(*_views(a, b, d), stream)
    torch.cuda.synchronize()
    product = a.double() @ b.double()
    expect = torch.nn.functional.gelu(product, approximate="tanh") if activation == "gelu" else product
    return _rel_err(d, expect)


def _timed_against_cublas(fn, a, b):
    """Three alternations of cuBLAS and `fn` (so drift under the power limit falls on both)."""
    import torch

    from bench.timing import alternate_ms
    times = alternate_ms({"cublas": lambda: torch.matmul(a, b), "fn": fn}, 3, 25, 200, return_mode="mean")
    return times["cublas"], times["fn"]


def run_on_gpu(shapes, configs, activations, with_epifuse, out):
    import torch
    torch.manual_seed(0)
    rows = []
    gpu = torch.cuda.get_device_name()

    def record(row):
        row["ratio"] = min(row["ms"]) / min(row["cublas_ms"])
        rows.append(row)
        print(f"{row['shape']} {row['activation']:8s} {row['kernel']:21s} ratio {row['ratio']:.3f} "
              f"cublas {min(row['cublas_ms'])*1e3:.0f} us kernel {min(row['ms'])*1e3:.0f} us "
              f"rel_err {row['rel_err']:.1e}", flush=True)

    for shape_name in shapes:
        M, N, K = SHAPES[shape_name]
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        product = a.double() @ b.double()
        for activation in activations:
            expect = torch.nn.functional.gelu(product, approximate="tanh") if activation == "gelu" else product
            base = {"shape": shape_name, "M": M, "N": N, "K": K, "activation": activation}
            for config in configs:
                d = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
                views = _views(a, b, d)
                compiled, stream, clusters, compile_s = _compile_on_gpu(config, activation, views)
                compiled(*views, stream)
                torch.cuda.synchronize()
                rel = _rel_err(d, expect)
                rel_unit = _unit_scale_error(compiled, a, b, activation, stream)
                cublas_ms, ms = _timed_against_cublas(lambda: compiled(*views, stream), a, b)
                record(dict(base, kernel="cute_" + config, cublas_ms=cublas_ms, ms=ms, rel_err=rel,
                            rel_err_unit_scale=rel_unit, compile_s=compile_s, clusters=clusters))
            if with_epifuse:
                import epifuse
                from epifuse.runtime import tune
                epi = _epifuse_gelu if activation == "gelu" else identity
                tunings = len(tune.HISTORY)
                d = epifuse.gemm(a, b, epi)  # one output: the tensor itself
                torch.cuda.synchronize()
                rel = _rel_err(d, expect)
                cublas_ms, ms = _timed_against_cublas(lambda: epifuse.gemm(a, b, epi), a, b)
                record(dict(base, kernel="epifuse", cublas_ms=cublas_ms, ms=ms, rel_err=rel,
                            choice=tune.HISTORY[-1]["choice"] if len(tune.HISTORY) > tunings else "kept"))
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"cute_probe_{time.strftime('%Y%m%d-%H%M%S')}_{gpu.replace(' ', '-')}.json")
        with open(path, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "cutlass_dsl": getattr(cutlass, "__version__", "?"),
                       "rows": rows}, f, indent=1)
    return rows


def launch_for_profiler(configs, activation, shape_name, gluon=()):
    """Each of `configs` (and each epifuse kernel whose repr is in `gluon`, on the same epilogue:
    identity or tanh-GELU, no bias)
    launched twice, then once between cudaProfilerStart and cudaProfilerStop, on the same random
    inputs: for `ncu --profile-from-start off ...`, which then sees one launch of each."""
    import torch

    import epifuse
    M, N, K = SHAPES[shape_name]
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    launches = []
    for config in configs:
        d = torch.empty(M, N, device="cuda", dtype=torch.float16)
        views = _views(a, b, d)
        compiled, stream, _, _ = _compile_on_gpu(config, activation, views)
        launches.append((config, (lambda c, v, s: lambda: c(*v, s))(compiled, views, stream)))
    epi = _epifuse_gelu if activation == "gelu" else identity
    args = epifuse.GemmArguments(a, b, epilogue=epifuse.EpilogueArguments(epi, D=torch.empty(M, N, device="cuda", dtype=torch.float16)))
    matched = [k for k in epifuse.get_kernels(args) if repr(k) in gluon]
    launches += [(repr(k), (lambda k: lambda: k.run(args))(k)) for k in matched]
    for name in sorted(set(gluon) - {repr(k) for k in matched}):
        print(f"cute_probe: epifuse offers no kernel {name} for these arguments", file=sys.stderr)
    for _, launch in launches:
        launch()
        launch()
    torch.cuda.synchronize()
    for name, launch in launches:
        print(f"profiling {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        launch()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="S1,S2,S3")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--activations", default=",".join(ACTIVATIONS))
    parser.add_argument("--epifuse", action="store_true", help="time epifuse.gemm on the same epilogues")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a, no GPU")
    parser.add_argument("--profile", action="store_true",
                        help="for ncu --profile-from-start off: one profiled launch of each config (first "
                             "activation and shape)")
    parser.add_argument("--gluon", default="",
                        help="with --profile: epifuse kernels to profile beside them, by repr, ';'-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    configs, activations = args.configs.split(","), args.activations.split(",")
    if args.profile:
        launch_for_profiler(configs, activations[0], args.shapes.split(",")[0],
                            [g for g in args.gluon.split(";") if g])
        return
    if args.compile_only:
        for config in configs:
            for activation in activations:
                start = time.perf_counter()
                compile_offline(config, activation, SHAPES["S1"])
                print(f"{config} {activation}: compiled for sm_90a in {time.perf_counter() - start:.1f} s")
        return
    run_on_gpu(args.shapes.split(","), configs, activations, args.epifuse, args.out)


if __name__ == "__main__":
    main()
