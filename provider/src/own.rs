//! Stages on our own kernels instead of libtorch: the generic
//! [`rookery_stage::StageWorker`] over [`rookery_stage::StageExecutor`], on a
//! GPU through wgpu (`--backend wgpu`, feature `wgpu`) or on the kernels' CPU
//! references. Its futures are driven to completion on the trainer thread.

use rookery_proto::{ToProvider, ToServer};
use rookery_stage::{Device, OwnFactory, StageWorker};

use crate::trainer::Trainer;

/// A [`Trainer`] running stages with our own executor on `D`.
pub struct OwnTrainer<D: Device> {
    worker: StageWorker<OwnFactory<D>>,
}

impl<D: Device> OwnTrainer<D> {
    pub fn new(device: D) -> Self {
        Self {
            worker: StageWorker::new(OwnFactory::new(device)),
        }
    }

    pub fn describe(&self) -> String {
        self.worker.factory().device().describe()
    }
}

impl<D> Trainer for OwnTrainer<D>
where
    D: Device + Send + Sync,
    D::Buffer: Send,
    D::Prepared: Send,
{
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        pollster::block_on(self.worker.handle(message))
    }
}
